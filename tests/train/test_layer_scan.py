"""Layer scan: the stacked layout (repeating blocks run by lax.scan) against the per-layer loop.

The plan of the target's 96 layers; pure-dict layout round trips; the same logits, losses,
gradients, sown statistics and train-step updates (1e-5) on several meshes, with remat; the decay
mask; a scanned training run's checkpoints, resume check and per-layer export.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import ConfigError, MeshConfig, load_config
from jaxmoe.layer_plan import (
    Stack,
    compiled_layers,
    describe,
    layer_count,
    layer_signatures,
    plan_layers,
    stack_layers,
    unstack_layers,
)
from jaxmoe.model import abstract_model, create_model, layer_plan
from jaxmoe.moe.router import RouterBias
from jaxmoe.sharding import make_mesh
from jaxmoe.train.optim import _decay_mask
from jaxmoe.train.step import forward, update_router_bias

# 7 layers, nested: 0 (mla, dense FFN), then 2 x [2 x kda, dsa].
KINDS = ("mla", "kda", "kda", "dsa", "kda", "kda", "dsa")


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def _assert_close(a: dict, b: dict, tol: float, what: str):
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert la.keys() == lb.keys(), what
    for path in la:
        np.testing.assert_allclose(
            np.asarray(la[path]), np.asarray(lb[path]), rtol=tol, atol=tol, err_msg=f"{what} {path}"
        )


def test_target_plan_covers_96_layers_with_12_bodies():
    cfg = load_config("configs/target.py")
    plan = layer_plan(cfg.model)
    assert layer_count(plan) == 96 and compiled_layers(plan) == 12
    outline = describe(plan)
    assert outline[0] == 0 and outline[1]["layers"] == [1, 64] and outline[1]["repeats"] == 2
    # Every layer once, in order; the layers a stack's slot holds have one signature (parameter structure).
    sig = layer_signatures(cfg.model.layer_kinds, cfg.model.moe.first_k_dense)
    order = []

    def walk(items, offset, slot_sigs):
        for j, x in enumerate(items):
            if isinstance(x, int):
                order.append(x + offset)
                slot_sigs.setdefault((id(items), j), set()).add(sig[x + offset])
            else:
                for r in range(x.repeats):
                    walk(x.block, offset + r * x.period, slot_sigs)

    slots = {}
    walk(plan, 0, slots)
    assert order == list(range(96))
    assert all(len(s) == 1 for s in slots.values())


def test_plan_shapes():
    assert plan_layers("aaaa") == (Stack((0,), 4, 1),)
    assert plan_layers("abc") == (0, 1, 2)
    # The longest cover wins; inside a block the same rule nests.
    assert plan_layers("xaabaab") == (0, Stack((Stack((1,), 2, 1), 3), 2, 3))
    assert describe(plan_layers("aab")) == [{"layers": [0, 1], "repeats": 2, "block": [0]}, 2]


def test_stack_unstack_round_trip_with_partial_trees():
    plan = plan_layers(layer_signatures(KINDS, 1))
    rng = np.random.default_rng(0)
    per_layer = {"embed": rng.standard_normal(3), "layers": {i: {"w": rng.standard_normal((2, 3))} for i in range(7)}}
    stacked = stack_layers(per_layer, plan)
    assert stacked["layers"][1]["block"]["0"]["block"]["0"]["w"].shape == (2, 2, 2, 3)
    back = unstack_layers(stacked, plan)
    assert list(back["layers"]) == list(range(7))
    _assert_close(back, per_layer, 0, "round trip")
    with pytest.raises(ValueError, match="layers \\[7\\] are not in the plan"):
        stack_layers({"layers": {**per_layer["layers"], 7: {"w": np.zeros((2, 3))}}}, plan)
    # Router biases: only MoE layers (1..6) have one.
    bias = {"layers": {i: {"b": np.full(4, i, np.float32)} for i in range(1, 7)}}
    assert 0 not in stack_layers(bias, plan)["layers"]
    _assert_close(unstack_layers(stack_layers(bias, plan), plan), bias, 0, "bias round trip")


@pytest.fixture(scope="module")
def scan_cfg(cfg):
    model = dataclasses.replace(
        cfg.model,
        num_layers=len(KINDS),
        layer_kinds=KINDS,
        moe=dataclasses.replace(cfg.model.moe, first_k_dense=1),
    )
    train = dataclasses.replace(
        cfg.train,
        remat=True,
        moe_balance=dataclasses.replace(cfg.train.moe_balance, bias_rate=0.01, seq_aux_loss_weight=1e-2),
        dsa=dataclasses.replace(cfg.train.dsa, indexer_loss_weight=1.0),
    )
    return dataclasses.replace(cfg, model=model, train=train)


@pytest.fixture(scope="module")
def tokens(scan_cfg):
    rng = np.random.default_rng(3)
    return rng.integers(0, scan_cfg.model.vocab_size, (8, 33)).astype(np.int32)


def test_same_values_in_both_layouts(scan_cfg):
    m = scan_cfg.model
    loop = nnx.to_pure_dict(nnx.state(create_model(m, seed=2)))
    scan = nnx.to_pure_dict(nnx.state(create_model(m, seed=2, scan=True)))
    stacked = stack_layers(loop, layer_plan(m))
    assert jax.tree.structure(stacked) == jax.tree.structure(scan)
    _assert_close(jax.tree.map(np.asarray, stacked), scan, 0, "init")


@pytest.mark.parametrize(
    ("kinds", "mesh_cfg", "stage", "remat"),
    [
        (KINDS, MeshConfig(fsdp=2, expert=2, tensor=2), "main", True),
        (("mla", "dsa", "dsa"), MeshConfig(data=2, expert=2, context=2), "warmup", False),
    ],
    ids=["nested-fsdp2_expert2_tensor2-main-remat", "dsa2-data2_expert2_context2-warmup"],
)
def test_scan_equals_loop_losses_and_gradients(scan_cfg, tokens, kinds, mesh_cfg, stage, remat):
    """Forward, sown losses and statistics, every gradient: the scanned model (the same values,
    stacked) against the per-layer loop."""
    model = dataclasses.replace(scan_cfg.model, num_layers=len(kinds), layer_kinds=kinds)
    cfg = dataclasses.replace(scan_cfg, model=model, mesh=mesh_cfg)
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    plan = layer_plan(cfg.model)
    mesh = make_mesh(mesh_cfg)
    results = {}
    with jax.set_mesh(mesh):
        model = create_model(cfg.model, seed=1, mesh=mesh)
        _, loop_params, loop_bias = nnx.split(model, nnx.Param, RouterBias)
        loop_params, loop_bias = nnx.to_pure_dict(loop_params), nnx.to_pure_dict(loop_bias)
        for scan in (False, True):
            graphdef = nnx.split(abstract_model(cfg.model, scan=scan), nnx.Param, RouterBias)[0]
            params, bias = loop_params, loop_bias
            if scan:
                params, bias = stack_layers(params, plan), stack_layers(bias, plan)

            def loss(params, graphdef=graphdef, bias=bias):
                out = forward(graphdef, params, bias, inputs, targets, cfg=cfg, stage=stage, remat=remat)
                return out.lm_loss + 1e-2 * out.seq_aux + out.indexer_kl, out

            (total, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
            if scan:
                grads = unstack_layers(grads, plan)
            results[scan] = (total, out, jax.tree.map(np.asarray, grads))
    (t0, o0, g0), (t1, o1, g1) = results[False], results[True]
    assert float(o0.indexer_kl) > 0 and float(o0.seq_aux) > 0
    np.testing.assert_allclose(float(t1), float(t0), rtol=1e-5)
    for name in ("lm_loss", "indexer_kl", "seq_aux"):
        np.testing.assert_allclose(float(getattr(o1, name)), float(getattr(o0, name)), rtol=1e-5, err_msg=name)
    assert o1.expert_load.keys() == o0.expert_load.keys() == set(range(1, len(kinds)))
    for i in o0.expert_load:
        np.testing.assert_array_equal(o1.expert_load[i], o0.expert_load[i])
        np.testing.assert_allclose(o1.drop_fraction[i], o0.drop_fraction[i], atol=1e-7)
    _assert_close(g1, g0, 1e-5, "grad")
    if stage == "warmup":  # the dense warm-up's KL differs from the sparse stage's: both were exercised
        assert any("indexer" in p for p, v in _leaves(g0) if np.any(v != 0))


def test_decay_mask_ignores_stacked_axes(scan_cfg):
    m = scan_cfg.model
    loop = nnx.to_pure_dict(nnx.state(create_model(m, seed=0), nnx.Param))
    scan = nnx.to_pure_dict(nnx.state(create_model(m, seed=0, scan=True), nnx.Param))
    want = stack_layers(_decay_mask(loop), layer_plan(m))
    got = _decay_mask(scan)
    # stack_layers stacks the per-layer booleans; every repetition agrees, so compare the first.
    flat_want = {p: bool(np.asarray(v).reshape(-1)[0]) for p, v in _leaves(want)}
    assert {p: bool(v) for p, v in _leaves(got)} == flat_want
    assert not flat_want[("layers", 1, "block", "0", "block", "0", "attn_norm", "weight")]


def test_router_bias_update_in_the_stacked_layout():
    plan = plan_layers(layer_signatures(KINDS, 1))
    rng = np.random.default_rng(1)
    per_layer = {
        "layers": {i: {"ffn": {"router_bias": jnp.asarray(rng.standard_normal(8), jnp.float32)}} for i in range(1, 7)}
    }
    loads = {i: jnp.asarray(rng.integers(0, 50, 8), jnp.int32) for i in range(1, 7)}
    want = update_router_bias(per_layer, loads, 0.01)
    got = update_router_bias(stack_layers(per_layer, plan), loads, 0.01, plan)
    assert jax.tree.structure(got) == jax.tree.structure(stack_layers(want, plan))
    _assert_close(jax.tree.map(np.asarray, unstack_layers(got, plan)), jax.tree.map(np.asarray, want), 0, "bias")


def test_scanned_run_checkpoints_export_and_resume_check(cfg, tmp_path):
    """A scanned training run (2 warm-up steps, then a main step with the bias update): its
    checkpoint restores as a per-layer model, its MXFP4 export is per layer with the trained
    values, and resuming it in the other layout is refused."""
    from jaxmoe.checkpoint.io import load_model  # noqa: PLC0415
    from jaxmoe.train.checkpoints import CHECKPOINT_DIR, EXPORT_DIR, restore_model  # noqa: PLC0415
    from jaxmoe.train.loop import train  # noqa: PLC0415

    model = dataclasses.replace(cfg.model, num_layers=4, layer_kinds=("mla", "kda", "kda", "dsa"))
    balance = dataclasses.replace(cfg.train.moe_balance, bias_rate=0.01)
    train_cfg = dataclasses.replace(
        cfg.train, steps=3, scan_layers=True, checkpoint_every=3, eval_every=0, moe_balance=balance
    )
    summary = train(dataclasses.replace(cfg, model=model, train=train_cfg), tmp_path, progress=False, stdout=False)
    assert summary["step"] == 3 and np.isfinite(summary["heldout_loss"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    stored_cfg, restored = restore_model(tmp_path / CHECKPOINT_DIR)
    assert stored_cfg.train.scan_layers and not restored.scan and len(restored.layers) == 4  # per layer again
    bias = dict(_leaves(nnx.to_pure_dict(nnx.state(restored, RouterBias))))
    assert len(bias) == 4 and all(np.any(np.asarray(v) != 0) for v in bias.values())  # the update ran

    _, exported = load_model(tmp_path / EXPORT_DIR)
    ref = dict(_leaves(nnx.to_pure_dict(nnx.state(restored, nnx.Param))))
    got = dict(_leaves(nnx.to_pure_dict(nnx.state(exported, nnx.Param))))
    # Per-layer paths; the weights the export does not pack into MXFP4 are the trained values.
    plain = [p for p in ref if p in got and "layers" in p]
    assert len(plain) > 20 and {p[1] for p in plain} == {0, 1, 2, 3}
    for path in plain:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(ref[path]), err_msg=str(path))

    other = dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, steps=4, scan_layers=False))
    with pytest.raises(ConfigError, match="scan_layers=True"):
        train(other, tmp_path, progress=False, stdout=False)
