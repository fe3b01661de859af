"""MoE FFN: router and block parity with HF DeepSeek-V3, fast path vs dense reference, sharding.

fp32 throughout, tolerance 1e-5. Dimensions are odd (D=24 split into groups of 3 and 4 experts,
F=7, T=11) so transposes cannot hide.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3MLP,
    DeepseekV3MoE,
    DeepseekV3TopkRouter,
)

from jaxmoe.checkpoint.hf_common import CheckpointError
from jaxmoe.checkpoint.hf_moe import load_mlp, load_moe
from jaxmoe.config import Config, MeshConfig, ModelConfig, MoEConfig, validate
from jaxmoe.moe import MLP, MoE, RouterBias, reference_moe, route
from jaxmoe.sharding import logical_to_spec, make_mesh, state_shardings

TOL = dict(rtol=1e-5, atol=1e-5)
D = 24


def _cfg(E=12, G=4, TG=2, K=3, F=7, shared=2, norm=True, scale=2.5, init_std=0.3) -> ModelConfig:
    cfg = ModelConfig(
        d_model=D,
        init_std=init_std,
        moe=MoEConfig(
            num_experts=E,
            experts_per_token=K,
            num_groups=G,
            topk_groups=TG,
            expert_ffw_dim=F,
            num_shared_experts=shared,
            dense_ffw_dim=13,
            norm_topk_prob=norm,
            routed_scaling_factor=scale,
        ),
    )
    validate(Config(model=cfg))
    return cfg


def _new_moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    """A MoE with N(0, init_std) weights drawn by numpy: no per-shape init compiles in tests."""
    moe = nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for _, v in nnx.iter_graph(moe):
        if isinstance(v, nnx.Variable):
            abstract = v.get_value()
            v.set_value(jnp.asarray(cfg.init_std * rng.normal(size=abstract.shape), abstract.dtype))
    return moe


def _hf_cfg(cfg: ModelConfig) -> DeepseekV3Config:
    m = cfg.moe
    return DeepseekV3Config(
        hidden_size=cfg.d_model,
        intermediate_size=m.dense_ffw_dim,
        moe_intermediate_size=m.expert_ffw_dim,
        n_routed_experts=m.num_experts,
        num_experts_per_tok=m.experts_per_token,
        n_group=m.num_groups,
        topk_group=m.topk_groups,
        n_shared_experts=m.num_shared_experts,
        norm_topk_prob=m.norm_topk_prob,
        routed_scaling_factor=m.routed_scaling_factor,
        hidden_act="silu",
        experts_implementation="eager",
    )


def _sorted_by_index(weights, indices):
    """Per row, (indices, weights) ordered by expert index, so top-k order does not matter."""
    weights, indices = np.asarray(weights), np.asarray(indices)
    order = np.argsort(indices, axis=-1)
    return np.take_along_axis(indices, order, -1), np.take_along_axis(weights, order, -1)


def _random_bias(rng, E):
    # Same magnitude as the spread of sigmoid scores, so the bias changes selections.
    return rng.uniform(-0.3, 0.3, size=E).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Router


@pytest.mark.parametrize(
    "G,TG,norm,scale",
    [(4, 2, True, 2.5), (3, 2, False, 1.0), (3, 1, True, 1.0), (1, 1, True, 2.5)],
)
def test_router_matches_hf(G, TG, norm, scale):
    cfg = _cfg(G=G, TG=TG, norm=norm, scale=scale)
    E, K = cfg.moe.num_experts, cfg.moe.experts_per_token
    rng = np.random.default_rng(G * 10 + TG)
    w = (0.3 * rng.normal(size=(E, D))).astype(np.float32)  # torch [E, D]
    bias = _random_bias(rng, E)
    x = rng.normal(size=(2 * 13, D)).astype(np.float32)

    hf = DeepseekV3TopkRouter(_hf_cfg(cfg))
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(w))
        hf.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, hf_w, hf_i = hf(torch.from_numpy(x))

    weights, indices, scores = route(jnp.asarray(x), jnp.asarray(w.T), jnp.asarray(bias), cfg.moe)
    assert weights.shape == (x.shape[0], K) and weights.dtype == jnp.float32
    assert indices.shape == (x.shape[0], K) and indices.dtype == jnp.int32
    assert scores.shape == (x.shape[0], E)

    ours_i, ours_w = _sorted_by_index(weights, indices)
    hf_i, hf_w = _sorted_by_index(hf_w.numpy(), hf_i.numpy())
    np.testing.assert_array_equal(ours_i, hf_i)
    np.testing.assert_allclose(ours_w, hf_w, **TOL)
    np.testing.assert_allclose(scores, torch.sigmoid(torch.from_numpy(x @ w.T)).numpy(), **TOL)

    # The test is only meaningful if the bias (and, with TG < G, the group limit) changes choices.
    _, unbiased_i, _ = route(jnp.asarray(x), jnp.asarray(w.T), jnp.zeros(E), cfg.moe)
    assert (np.sort(np.asarray(unbiased_i), -1) != ours_i).any()
    if TG < G:
        ungrouped = dataclasses.replace(cfg.moe, topk_groups=G)
        _, ungrouped_i, _ = route(jnp.asarray(x), jnp.asarray(w.T), jnp.asarray(bias), ungrouped)
        assert (np.sort(np.asarray(ungrouped_i), -1) != ours_i).any()


# ------------------------------------------------------------------------------------------
# HF parity of the blocks (and the loaders)


def _torch_init(module: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)


def _saved_layout(state_dict, prefix: str) -> dict[str, np.ndarray]:
    """transformers' in-memory DeepseekV3MoE state dict -> the per-expert layout saved on disk."""
    out = {}
    for k, v in state_dict.items():
        v = v.detach().numpy()
        if k == "experts.gate_up_proj":  # [E, 2F, D]: gate rows first, then up
            F = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = v[e, :F]
                out[f"{prefix}experts.{e}.up_proj.weight"] = v[e, F:]
        elif k == "experts.down_proj":  # [E, D, F]
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.down_proj.weight"] = v[e]
        else:
            out[prefix + k] = v
    return out


def _torch_fwd_bwd(module, x, r):
    xt = torch.from_numpy(x).requires_grad_(True)
    y = module(xt)
    (y * torch.from_numpy(r)).sum().backward()
    return y.detach().numpy(), xt.grad.numpy()


def _jax_fwd_bwd(fn, x, r):
    @jax.jit
    def run(x, r):
        y, vjp = jax.vjp(fn, x)
        return y, vjp(r)[0]

    y, g = run(jnp.asarray(x), jnp.asarray(r))
    return np.asarray(y), np.asarray(g)


def test_mlp_matches_hf():
    cfg = _cfg()
    F = cfg.moe.dense_ffw_dim
    hf = DeepseekV3MLP(_hf_cfg(cfg), intermediate_size=F)
    _torch_init(hf, 0)
    mlp = MLP(D, F, cfg, rngs=nnx.Rngs(0))
    load_mlp(mlp, {f"mlp.{k}": v.numpy() for k, v in hf.state_dict().items()}, "mlp.")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 11, D)).astype(np.float32)
    r = rng.normal(size=(2, 11, D)).astype(np.float32)
    hf_y, hf_g = _torch_fwd_bwd(hf, x, r)
    y, g = _jax_fwd_bwd(mlp, x, r)
    np.testing.assert_allclose(y, hf_y, **TOL)
    np.testing.assert_allclose(g, hf_g, **TOL)


@pytest.mark.parametrize("G,TG,shared", [(4, 2, 2), (3, 2, 1)])
def test_moe_matches_hf(G, TG, shared):
    cfg = _cfg(G=G, TG=TG, shared=shared)
    hf = DeepseekV3MoE(_hf_cfg(cfg))
    _torch_init(hf, G)
    rng = np.random.default_rng(G)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.from_numpy(_random_bias(rng, cfg.moe.num_experts)))

    moe = _new_moe(cfg)
    prefix = "model.layers.3.mlp."
    load_moe(moe, _saved_layout(hf.state_dict(), prefix), prefix)
    np.testing.assert_array_equal(moe.router_bias[...], hf.gate.e_score_correction_bias.numpy())

    x = rng.normal(size=(2, 11, D)).astype(np.float32)
    r = rng.normal(size=(2, 11, D)).astype(np.float32)
    hf_y, hf_g = _torch_fwd_bwd(hf, x, r)
    y, g = _jax_fwd_bwd(moe, x, r)
    np.testing.assert_allclose(y, hf_y, **TOL)
    np.testing.assert_allclose(g, hf_g, **TOL)


def test_load_moe_errors():
    cfg = _cfg(shared=0)
    hf = DeepseekV3MoE(_hf_cfg(_cfg(shared=1)))
    tensors = _saved_layout(hf.state_dict(), "p.")
    moe = _new_moe(cfg)
    assert moe.shared is None
    with pytest.raises(CheckpointError, match="num_shared_experts=0"):
        load_moe(moe, tensors, "p.")
    missing = {k: v for k, v in tensors.items() if k != "p.experts.5.up_proj.weight"}
    with pytest.raises(CheckpointError, match="p.experts.5.up_proj.weight"):
        load_moe(_new_moe(_cfg(shared=1)), missing, "p.")
    with pytest.raises(CheckpointError, match="more routed experts"):
        load_moe(_new_moe(_cfg(E=8, G=4, shared=1)), tensors, "p.")
    with pytest.raises(CheckpointError, match="fused"):
        load_moe(moe, {f"p.{k}": v.detach().numpy() for k, v in hf.state_dict().items()}, "p.")


# ------------------------------------------------------------------------------------------
# Fast path vs the dense reference


def _randomized_moe(cfg: ModelConfig, seed: int) -> MoE:
    moe = _new_moe(cfg, seed)
    bias = _random_bias(np.random.default_rng(seed), cfg.moe.num_experts)
    bias[seed] = -10.0  # expert `seed` is never chosen: its group in the grouped matmul is empty
    moe.router_bias[...] = jnp.asarray(bias)
    return moe


def test_module_structure():
    cfg = _cfg(shared=2)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    assert not np.any(moe.router_bias[...])
    E, F = cfg.moe.num_experts, cfg.moe.expert_ffw_dim
    assert isinstance(moe.router_bias, RouterBias) and not isinstance(moe.router_bias, nnx.Param)
    assert moe.router[...].dtype == jnp.float32 and moe.router[...].shape == (D, E)
    assert moe.w_gate.get_metadata()["axes"] == ("experts", "embed", "expert_ffw")
    assert moe.w_down[...].shape == (E, F, D)
    assert moe.shared.gate[...].shape == (D, 2 * F)
    # Only nnx.Param is trained: the bias stays out of the optimizer's state.
    assert "router_bias" not in nnx.state(moe, nnx.Param)


def _loss_and_grads(fn):
    def loss(m, x, r):
        y = fn(m, x)
        return jnp.sum(y * r), y

    # Module level, so the three seeds share one compilation.
    return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))


_fast_loss_and_grads = _loss_and_grads(lambda m, x: m(x))
_ref_loss_and_grads = _loss_and_grads(reference_moe)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_path_matches_reference(seed):
    cfg = _cfg(shared=1)
    moe = _randomized_moe(cfg, seed)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(2, 11, D)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(2, 11, D)), jnp.float32)

    (lf, y_fast), (gm_fast, gx_fast) = _fast_loss_and_grads(moe, x, r)
    (lr, y_ref), (gm_ref, gx_ref) = _ref_loss_and_grads(moe, x, r)
    np.testing.assert_allclose(y_fast, y_ref, **TOL)
    np.testing.assert_allclose(lf, lr, **TOL)
    np.testing.assert_allclose(gx_fast, gx_ref, **TOL)
    flat_fast = dict(nnx.to_flat_state(gm_fast))
    flat_ref = dict(nnx.to_flat_state(gm_ref))
    assert set(flat_fast) == set(flat_ref)
    assert {p[-1] for p in flat_fast} >= {"router", "w_gate", "w_up", "w_down", "gate", "up", "down"}
    for path, g in flat_fast.items():
        np.testing.assert_allclose(g[...], flat_ref[path][...], err_msg=str(path), **TOL)
    # The never-chosen expert gets no gradient; others do.
    assert not np.any(flat_fast[("w_down",)][...][seed])
    assert np.any(flat_fast[("w_down",)][...])


# ------------------------------------------------------------------------------------------
# Sharded vs single device


@functools.partial(jax.jit, static_argnums=0)
def _sharded_fwd_bwd(graphdef, state, x, r):
    def loss(state, x):
        y = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * r), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
    return y, grads


def _sharded_cfg():
    return _cfg(F=6, shared=1)  # E=12, F=6, shared F=6: divisible by every mesh axis used


def _sharded_case():
    graphdef, state = nnx.split(_randomized_moe(_sharded_cfg(), 1))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(8, 5, D)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(8, 5, D)), jnp.float32)
    return graphdef, state, x, r


@pytest.fixture(scope="module")
def single_device_result():
    # Module scope: set up before the function-scoped `mesh` fixture enters its mesh.
    graphdef, state, x, r = _sharded_case()
    with jax.set_mesh(make_mesh(MeshConfig(), devices=jax.devices()[:1])):
        return jax.device_get(_sharded_fwd_bwd(graphdef, state, x, r))


def test_sharded_matches_single_device(single_device_result, mesh):
    y_one, (gs_one, gx_one) = single_device_result
    graphdef, state, x, r = _sharded_case()
    sharded = jax.device_put(state, state_shardings(state, mesh))
    assert sharded["w_gate"][...].sharding.spec == logical_to_spec(("experts", "embed", "expert_ffw"))
    xs = jax.device_put(x, NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"))))
    y, (gs, gx) = _sharded_fwd_bwd(graphdef, sharded, xs, r)

    assert len(y.sharding.device_set) == 8
    np.testing.assert_allclose(y, y_one, **TOL)
    np.testing.assert_allclose(gx, gx_one, **TOL)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gs_one), strict=True):
        np.testing.assert_allclose(a, b, **TOL)
