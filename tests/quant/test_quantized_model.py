"""Packed MXFP4 weights in the model: layout, matmuls, sharding, state conversion, checkpoints.

The MXFP4 paths are compared with the float paths given the exactly dequantized weights, so the
only difference allowed is summation order (fp32, 1e-5). Dimensions: the contracting dims are
odd multiples of 32 (96, 160); the others odd (E=5, O=13, M=37).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jaxmoe.checkpoint.io import load_model, save_model
from jaxmoe.config import Config, ConfigError, MeshConfig, MLAConfig, ModelConfig, MoEConfig, validate
from jaxmoe.model import abstract_model, create_model, shard_model
from jaxmoe.moe.grouped import grouped_matmul
from jaxmoe.nn import dense
from jaxmoe.quant import (
    ROUTED_EXPERTS,
    MXFP4Param,
    QArray,
    dequantize_state,
    mxfp4,
    packed_axes,
    quantize_state,
    quantize_weight,
)
from jaxmoe.sharding import logical_to_spec, make_mesh, state_shardings

TOL = dict(rtol=0, atol=1e-5)


def _qweight(seed, shape, axis, scale=0.1):
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * np.float32(scale)
    q = quantize_weight(w, axis)
    return q, q.dequantize(jnp.float32)


def test_layout_is_gpt_oss_blocks_along_the_contracting_dim():
    w = np.random.default_rng(0).normal(size=(5, 96, 13)).astype(np.float32)  # [E, I, O], contracts I
    q = quantize_weight(w, 1)
    blocks, scales = q.arrays()
    assert blocks.shape == (5, 13, 3, 16) and scales.shape == (5, 13, 3) and q.shape == (5, 96, 13)
    want_b, want_s = mxfp4.quantize(np.ascontiguousarray(np.moveaxis(w, 1, -1)))  # [E, O, I]
    np.testing.assert_array_equal(np.asarray(blocks), np.asarray(want_b))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_s))
    deq = np.asarray(q.dequantize())
    np.testing.assert_array_equal(deq, np.moveaxis(np.asarray(mxfp4.dequantize(want_b, want_s)), -1, 1))
    assert packed_axes(("experts", "embed", "expert_ffw"), 1) == (
        ("experts", "expert_ffw", "embed", None),
        ("experts", "expert_ffw", "embed"),
    )
    with pytest.raises(ValueError, match=r"needs blocks \(5, 13, 3, 16\)"):
        QArray(blocks[:, :, :2], scales, (5, 96, 13), 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_with_qarray_equals_dense_with_dequantized_weight(seed):
    q, w = _qweight(seed, (160, 3, 7), 0)  # [D, N, H] projection to heads, contracts D
    x = jnp.asarray(np.random.default_rng(seed + 10).normal(size=(2, 11, 160)), jnp.float32)
    f = lambda x, w: jnp.sum(jnp.sin(dense("BTD,DNH->BTNH", x, w)))
    np.testing.assert_allclose(dense("BTD,DNH->BTNH", x, q), dense("BTD,DNH->BTNH", x, w), **TOL)
    np.testing.assert_allclose(jax.grad(f)(x, q), jax.grad(f)(x, w), **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block", [4, 16])
def test_grouped_matmul_with_qarray_equals_float_weights(seed, block):
    E, I, O, M = 5, 96, 13, 37
    q, w = _qweight(seed, (E, I, O), 1)
    rng = np.random.default_rng(seed + 10)
    x = jnp.asarray(rng.normal(size=(M, I)), jnp.float32)
    sizes = jnp.asarray([9, 0, 17, 3, 6], jnp.int32)  # an empty group; 2 trailing rows owned by none
    r = jnp.asarray(rng.normal(size=(M, O)), jnp.float32)

    def f(x, w, impl):
        return grouped_matmul(x, w, sizes, impl=impl, block=block, precision=jax.lax.Precision.HIGHEST)

    got = jax.jit(lambda x: f(x, q, "auto"))(x)
    np.testing.assert_allclose(got, f(x, w, "blocked"), **TOL)
    np.testing.assert_allclose(got, f(x, w, "ragged"), **TOL)
    assert not np.asarray(got[35:]).any()
    loss = lambda x, w, impl: jnp.sum(f(x, w, impl) * r)
    np.testing.assert_allclose(jax.grad(loss)(x, q, "auto"), jax.grad(loss)(x, w, "ragged"), **TOL)


def _cfg(**kw) -> ModelConfig:
    # D/32 = 4 blocks (divisible by fsdp <= 4), F/32 = 2 (divisible by tensor <= 2).
    return ModelConfig(
        vocab_size=98,
        d_model=128,
        num_layers=1,
        layer_kinds=("mla",),
        init_std=0.05,
        mla=MLAConfig(num_heads=2, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8),
        moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffw_dim=64, num_groups=2, topk_groups=2),
        **kw,
    )


@pytest.fixture(scope="module")
def models():
    """(MXFP4-expert model, float model given its dequantized weights, the configs), single device."""
    qcfg = _cfg(mxfp4_weights=ROUTED_EXPERTS)
    fcfg = dataclasses.replace(qcfg, mxfp4_weights=())
    qmodel = create_model(qcfg, seed=0)
    fmodel = abstract_model(fcfg)
    graphdef, state = nnx.split(fmodel)
    nnx.replace_by_pure_dict(state, dequantize_state(nnx.to_pure_dict(nnx.state(qmodel)), qcfg))
    return qmodel, nnx.merge(graphdef, state), qcfg, fcfg


def _loss_and_grads(model, tokens):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def f(params, rest, tokens):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

        return jax.value_and_grad(loss, has_aux=True)(params)

    (loss, logits), grads = f(params, rest, tokens)
    return logits, nnx.to_pure_dict(grads)


def test_quantized_model_state_and_shardings(models):
    qmodel, _, qcfg, _ = models
    ffn = qmodel.layers[0].ffn
    assert isinstance(ffn.w_gate, QArray) and isinstance(ffn.w_gate.blocks, MXFP4Param)
    assert ffn.w_gate.shape == (4, 128, 64) and ffn.w_down.shape == (4, 64, 128)
    state = nnx.to_pure_dict(nnx.state(qmodel))["layers"][0]["ffn"]
    assert state["w_gate"]["blocks"].shape == (4, 64, 4, 16) and state["w_down"]["scales"].shape == (4, 128, 2)
    assert not isinstance(ffn.w_gate.blocks, nnx.Param)  # frozen: gradient filters on nnx.Param skip it
    # Abstract model: shapes only, and the rule shardings of blocks keep the expert axis.
    abstract = abstract_model(qcfg)
    assert isinstance(abstract.layers[0].ffn.w_up.blocks.get_value(), jax.ShapeDtypeStruct)
    mesh = jax.sharding.AbstractMesh((2, 1, 2, 1, 2), ("data", "fsdp", "expert", "context", "tensor"))
    sh = state_shardings(nnx.state(abstract), mesh)
    assert sh["layers"][0]["ffn"]["w_up"]["blocks"].get_value().spec == logical_to_spec(
        ("experts", "expert_ffw", "embed", None)
    )


def test_state_round_trip(models):
    qmodel, fmodel, qcfg, _ = models
    qstate = nnx.to_pure_dict(nnx.state(qmodel))
    again = quantize_state(nnx.to_pure_dict(nnx.state(fmodel)), qcfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), qstate, again)
    bad = nnx.to_pure_dict(nnx.state(fmodel))
    bad["layers"][0]["ffn"]["w_down"] = bad["layers"][0]["ffn"]["w_down"].at[2, 5, 7].set(jnp.nan)
    with pytest.raises(ValueError, match=r"layers/0/ffn/w_down: .*NaN or Inf.*index \(2, 7, 5\)"):
        quantize_state(bad, qcfg)


@pytest.fixture(scope="module")
def float_reference(models):
    tokens = np.random.default_rng(0).integers(0, 98, (8, 11), dtype=np.int32)
    return tokens, *_loss_and_grads(models[1], tokens)


# Experts sharded over `expert` (with tensor-sharded F); D/32 blocks sharded over fsdp.
MESHES = {
    "data2_expert2_tensor2": MeshConfig(data=2, expert=2, tensor=2),
    "fsdp4_tensor2": MeshConfig(fsdp=4, tensor=2),
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_mxfp4_model_equals_dequantized_float_model_sharded(models, float_reference, mesh_name):
    """Logits and grads (wrt the float params) on the 8-device mesh equal the float model's."""
    mesh = make_mesh(MESHES[mesh_name])
    with jax.set_mesh(mesh):
        _check_sharded(models[0], float_reference, mesh)


def _check_sharded(qmodel, float_reference, mesh):
    tokens, f_logits, f_grads = float_reference
    qmodel = shard_model(qmodel, mesh)
    blocks = qmodel.layers[0].ffn.w_gate.blocks[...]
    assert blocks.dtype == jnp.uint8
    assert blocks.sharding.spec == logical_to_spec(("experts", "expert_ffw", "embed", None))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if sizes["expert"] > 1:
        assert blocks.sharding.spec[0] == "expert" and not blocks.sharding.is_fully_replicated
    tokens = jax.device_put(tokens, NamedSharding(mesh, logical_to_spec(("batch", "seq"))))
    q_logits, q_grads = _loss_and_grads(qmodel, tokens)
    np.testing.assert_allclose(np.asarray(q_logits), np.asarray(f_logits), **TOL)
    assert "w_gate" not in q_grads["layers"][0]["ffn"]
    f_grads = jax.tree.map(lambda x: x, f_grads)  # a copy: the fixture is shared
    f_grads["layers"][0]["ffn"] = {k: v for k, v in f_grads["layers"][0]["ffn"].items() if k not in ROUTED_EXPERTS}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL), q_grads, f_grads)


def test_checkpoint_round_trip(models, tmp_path):
    qmodel, _, qcfg, _ = models
    save_model(qmodel, Config(model=qcfg), tmp_path / "ckpt")
    cfg, restored = load_model(tmp_path / "ckpt")
    assert cfg.model.mxfp4_weights == ROUTED_EXPERTS
    a, b = nnx.to_pure_dict(nnx.state(qmodel)), nnx.to_pure_dict(nnx.state(restored))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert b["layers"][0]["ffn"]["w_gate"]["scales"].dtype == jnp.uint8


def test_config_names_bad_mxfp4_fields():
    with pytest.raises(ConfigError, match=r"model.mxfp4_weights\[1\]: unknown weight 'router'"):
        validate(Config(model=_cfg(mxfp4_weights=("w_up", "router"))))
    with pytest.raises(ConfigError, match="model.moe.expert_ffw_dim: 64 is not divisible by 128"):
        validate(Config(model=_cfg(mxfp4_weights=("w_down",)), mesh=MeshConfig(tensor=4, data=2)))
    with pytest.raises(ConfigError, match="model.d_model: 128 is not divisible by 256"):
        validate(Config(model=_cfg(mxfp4_weights=("w_gate",)), mesh=MeshConfig(fsdp=8)))
    validate(Config(model=_cfg(mxfp4_weights=("w_gate",)), mesh=MeshConfig(fsdp=4, tensor=2)))
