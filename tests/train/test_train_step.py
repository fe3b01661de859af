"""The train step's parts against numpy: learning-rate schedule, sequence-wise balance loss and its
gradient, the router-bias update; the DSA warm-up trains only the indexer; the bias update evens a
skewed expert load; remat and bf16 compute."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import MeshConfig, OptimConfig
from jaxmoe.model import create_model
from jaxmoe.moe.router import RouterBias, sequence_balance_loss
from jaxmoe.sharding import make_mesh
from jaxmoe.train.optim import learning_rate
from jaxmoe.train.step import Trainer, cross_entropy, forward, update_router_bias


def _host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def _replace(cfg, **train):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def _with_model(cfg, **model):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def test_learning_rate_schedule():
    o = OptimConfig(learning_rate=2e-3, warmup_steps=4, min_lr_ratio=0.1)
    steps = 14
    lr = learning_rate(o, steps)
    got = np.array([float(lr(i)) for i in range(steps + 2)])
    want = []
    for i in range(steps + 2):
        if i < 4:
            want.append(2e-3 * (i + 1) / 4)
        else:
            progress = min((i - 4) / (steps - 4 - 1), 1.0)
            want.append(2e-4 + (2e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * progress)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[3] == pytest.approx(2e-3) and got[steps - 1] == pytest.approx(2e-4)


def _balance_loss_numpy(scores, indices, E):
    """DeepSeek-V3 eqs. 17-20, loop by loop, and its gradient with respect to the scores."""
    B, T, K = indices.shape
    loss, grad = 0.0, np.zeros_like(scores, dtype=np.float64)
    for b in range(B):
        f = np.zeros(E)
        for t in range(T):
            for k in range(K):
                f[indices[b, t, k]] += E / (K * T)
        s = scores[b].astype(np.float64)
        norm = s.sum(axis=-1, keepdims=True)
        P = (s / norm).mean(axis=0)
        loss += (f * P).sum() / B
        grad[b] = (f[None, :] / norm - (s * f[None, :]).sum(-1, keepdims=True) / norm**2) / (T * B)
    return loss, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cross_entropy_and_its_gradient(seed):
    rng = np.random.default_rng(seed)
    B, T, V = 3, 7, 13
    logits = (3 * rng.standard_normal((B, T, V))).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    loss, grad = jax.value_and_grad(cross_entropy)(jnp.asarray(logits), jnp.asarray(targets))
    x = logits.astype(np.float64)
    log_p = x - x.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    onehot = np.eye(V)[targets]
    np.testing.assert_allclose(float(loss), -np.mean(np.sum(onehot * log_p, -1)), rtol=1e-6)
    np.testing.assert_allclose(grad, (np.exp(log_p) - onehot) / (B * T), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_balance_loss(seed):
    rng = np.random.default_rng(seed)
    B, T, E, K = 3, 11, 7, 2
    scores = rng.uniform(0.05, 0.95, (B, T, E)).astype(np.float32)
    indices = np.stack([rng.permutation(E)[:K] for _ in range(B * T)]).reshape(B, T, K).astype(np.int32)
    want, want_grad = _balance_loss_numpy(scores, indices, E)
    got, got_grad = jax.value_and_grad(sequence_balance_loss)(jnp.asarray(scores), jnp.asarray(indices), E)
    assert float(got) == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-4, atol=1e-7)


def test_update_router_bias():
    rng = np.random.default_rng(0)
    bias = {"layers": {1: {"ffn": {"router_bias": rng.normal(size=8).astype(np.float32)}}, 3: {"ffn": {}}}}
    bias["layers"][3]["ffn"]["router_bias"] = rng.normal(size=8).astype(np.float32)
    loads = {1: np.array([4, 4, 4, 4, 4, 4, 4, 4]), 3: np.array([9, 0, 3, 4, 5, 1, 2, 8])}
    new = update_router_bias(jax.tree.map(jnp.asarray, bias), jax.tree.map(jnp.asarray, loads), 0.01)
    np.testing.assert_array_equal(new["layers"][1]["ffn"]["router_bias"], bias["layers"][1]["ffn"]["router_bias"])
    mean = loads[3].mean()  # 4.0: experts above it lose 0.01, below gain 0.01, at it stay
    expected = bias["layers"][3]["ffn"]["router_bias"] + 0.01 * np.sign(mean - loads[3])
    np.testing.assert_allclose(new["layers"][3]["ffn"]["router_bias"], expected, rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def batch(cfg):
    """A fixed batch ``[8, 33]`` of the test config's training tokens."""
    from jaxmoe.data.pipeline import PackedBatches, build_token_data  # noqa: PLC0415

    d = cfg.train.data
    data = build_token_data(
        vocab_size=cfg.model.vocab_size,
        max_bytes=d.max_bytes,
        heldout_fraction=d.heldout_fraction,
        cache_dir=d.cache_dir,
    )
    return next(PackedBatches(data.train, seq_len=32, batch_size=8, seed=0))


def test_dense_warmup_trains_only_the_indexer(cfg, batch):
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        state = trainer.init_state(0)
        before = _host(state)
        state, metrics = trainer.step_fn("warmup")(state, *trainer.batch(batch))
        after = _host(state)
    assert float(metrics["indexer_kl"]) > 0 and float(metrics["total_loss"]) == float(metrics["indexer_kl"])
    indexer, others = 0, 0
    for path, b in _leaves(before.params):
        a = dict(_leaves(after.params))[path]
        if "indexer" in path:
            indexer += not np.array_equal(a, b)
        else:
            others += 1
            np.testing.assert_array_equal(a, b, err_msg=str(path))  # bitwise unchanged
    assert indexer == len([p for p, _ in _leaves(before.params) if "indexer" in p]) and others > 10
    for (_, b), (_, a) in zip(_leaves(before.router_bias), _leaves(after.router_bias), strict=True):
        np.testing.assert_array_equal(a, b)
    jax.tree.map(np.testing.assert_array_equal, after.opt_state, before.opt_state)
    assert int(after.indexer_opt_state[1][0].count) == 1


def test_bias_update_evens_skewed_load(cfg, batch):
    """Router bias +0.1 on experts 0 and 1: they take almost every token; the update evens the load."""
    cfg = _with_model(cfg, layer_kinds=("mla",))
    cfg = _replace(cfg, dsa=dataclasses.replace(cfg.train.dsa, warmup_steps=0), steps=10)
    cfg = _replace(cfg, moe_balance=dataclasses.replace(cfg.train.moe_balance, bias_rate=0.01))
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        state = trainer.init_state(0)
        skew = np.zeros(8, np.float32)
        skew[:2] = 0.1
        bias = {"layers": {0: {"ffn": {"router_bias": jax.device_put(skew, trainer.replicated)}}}}
        state = state._replace(router_bias=bias)
        step = trainer.step_fn("main")
        inputs, targets = trainer.batch(batch)
        ratios, losses, biases, loads = [], [], [skew], []
        for _ in range(cfg.train.steps):
            state, metrics = step(state, inputs, targets)
            load = np.asarray(metrics["expert_load"][0])
            loads.append(load)
            ratios.append(load.max() / load.mean())
            losses.append(float(metrics["loss"]))
            biases.append(np.asarray(state.router_bias["layers"][0]["ffn"]["router_bias"]))
    assert ratios[0] > 3.0, ratios  # 4 is all tokens on experts 0 and 1
    # Each step moves the bias by rate x sign(mean - load) of that step's own load.
    for k in range(cfg.train.steps):
        np.testing.assert_allclose(biases[k + 1], biases[k] + 0.01 * np.sign(loads[k].mean() - loads[k]), atol=1e-6)
    assert max(ratios[-3:]) < 2.0, ratios
    assert losses[-1] < losses[0], losses


def _small_model_cfg(cfg, kinds=("dsa",)):
    return _with_model(cfg, num_layers=len(kinds), layer_kinds=kinds)


def test_remat_same_losses_and_grads(cfg, batch):
    # An mla layer: what the layer sows (router choices, MoE stats) must come out of jax.checkpoint;
    # a dsa layer's sown input takes the same path (and costs ~30 s more compilation on CPU).
    cfg = _small_model_cfg(dataclasses.replace(cfg, mesh=MeshConfig()), kinds=("mla",))
    model = create_model(cfg.model, seed=1)
    graphdef, params, bias = nnx.split(model, nnx.Param, RouterBias)
    params, bias = nnx.to_pure_dict(params), nnx.to_pure_dict(bias)
    inputs, targets = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])

    def loss(params, remat):
        out = forward(graphdef, params, bias, inputs, targets, cfg=cfg, stage="main", remat=remat)
        return out.lm_loss + 1e-2 * out.seq_aux + out.indexer_kl, out

    results = {}
    for remat in (False, True):
        (total, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, remat)
        results[remat] = (total, out, grads)
    (t0, o0, g0), (t1, o1, g1) = results[False], results[True]
    assert float(t1) == pytest.approx(float(t0), abs=1e-6)
    assert float(o1.seq_aux) == pytest.approx(float(o0.seq_aux), abs=1e-6)  # sown values survive remat
    assert float(o1.seq_aux) > 0
    np.testing.assert_array_equal(o1.expert_load[0], o0.expert_load[0])
    for (path, a), (_, b) in zip(_leaves(g1), _leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_bf16_compute_with_fp32_master_weights(cfg, batch):
    cfg = _small_model_cfg(dataclasses.replace(cfg, mesh=MeshConfig()), kinds=("mla",))
    cfg = _replace(cfg, dsa=dataclasses.replace(cfg.train.dsa, warmup_steps=0))
    bf16 = _with_model(cfg, dtype="bfloat16", param_dtype="float32")
    mesh = make_mesh(cfg.mesh, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        trainer = Trainer(bf16, mesh)
        state = trainer.init_state(0)
        reference = Trainer(cfg, mesh).eval_fn("main")(state, *trainer.batch(batch))  # fp32 compute, same weights
        new, metrics = trainer.step_fn("main")(state, *trainer.batch(batch))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.opt_state) if jnp.issubdtype(x.dtype, jnp.floating))
    # bf16 activations: the same loss to bf16 precision, not bitwise.
    assert float(metrics["loss"]) == pytest.approx(float(reference), abs=3e-2)
    assert float(metrics["loss"]) != float(reference)
    assert math.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
