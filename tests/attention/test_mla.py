"""MLA against HF DeepseekV3Attention / KimiLinearAttention (forward and input gradient), and
the absorbed (decode) form against the expanded one."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3Config, KimiLinearConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from jaxmoe.attention.mla import MLA
from jaxmoe.checkpoint.hf_attention import load_mla
from jaxmoe.checkpoint.hf_common import CheckpointError
from jaxmoe.config import MLAConfig, ModelConfig, RopeConfig

ATOL = 1e-5
B, T = 2, 9
D, N, NOPE, ROPE, V, C, Q = 24, 3, 6, 4, 5, 11, 13
YARN = dict(factor=4.0, original_max_position=16, beta_fast=32.0, beta_slow=1.0, mscale=0.7, mscale_all_dim=1.0)

# name -> (HF family, q_lora_rank (0: none), rope type (None: NoPE))
CASES = {
    "v3_yarn": ("deepseek_v3", Q, "yarn"),
    "v3_default_rope": ("deepseek_v3", Q, "default"),
    "v3_no_q_lora": ("deepseek_v3", 0, "yarn"),
    "kimi_nope": ("kimi_linear", 0, None),
}


def _configs(family, q_lora, rope):
    dims = dict(hidden_size=D, num_attention_heads=N, num_key_value_heads=N, kv_lora_rank=C)
    dims |= dict(qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, attn_implementation="eager")
    mla = MLAConfig(
        num_heads=N, q_lora_rank=q_lora, kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, use_rope=rope is not None,
    )  # fmt: skip
    if family == "kimi_linear":
        return KimiLinearConfig(q_lora_rank=None, **dims), ModelConfig(d_model=D, mla=mla)
    rope_params = {"rope_type": "default", "rope_theta": 10000.0}
    ours = RopeConfig()
    if rope == "yarn":
        rope_params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": YARN["factor"]}
        rope_params |= {"original_max_position_embeddings": YARN["original_max_position"]}
        rope_params |= {k: YARN[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
        ours = RopeConfig(type="yarn", **YARN)
    hf = DeepseekV3Config(q_lora_rank=q_lora or None, max_position_embeddings=64, rope_parameters=rope_params, **dims)
    return hf, ModelConfig(d_model=D, mla=mla, rope=ours)


def _randomize(module, seed):
    torch.manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name:  # norms start at ones: perturb them so a transposed weight would show
            p.data = 1.0 + 0.3 * torch.randn_like(p)
    return module


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    cot = rng.standard_normal((B, T, D)).astype(np.float32)
    positions = (np.arange(T)[None, :] + np.array([[0], [7]])).astype(np.int32)  # absolute, per row
    return x, cot, positions


def _hf_forward_and_grad(hf_cfg, module, x, cot, positions):
    x_t = torch.tensor(x, requires_grad=True)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    if isinstance(module, KimiLinearAttention):
        y = module(x_t, attention_mask=mask)[0]
    else:
        pe = DeepseekV3RotaryEmbedding(hf_cfg)(x_t, torch.tensor(positions, dtype=torch.long))
        y = module(x_t, position_embeddings=pe, attention_mask=mask)[0]
    (y * torch.tensor(cot)).sum().backward()
    return y.detach().numpy(), x_t.grad.numpy()


@functools.partial(jax.jit, static_argnums=0)
def _forward_and_grad(graphdef, state, x, cot, positions):
    def f(x):
        return nnx.merge(graphdef, state)(x, positions)

    y, vjp = jax.vjp(f, x)
    return y, vjp(cot)[0]


def _ours(cfg, hf_module):
    model = MLA(cfg, rngs=nnx.Rngs(0))
    load_mla(model, {k: v.numpy() for k, v in hf_module.state_dict().items()}, "")
    return model


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_hf_forward_and_input_grad(case, seed):
    family, q_lora, rope = CASES[case]
    hf_cfg, cfg = _configs(family, q_lora, rope)
    cls = KimiLinearAttention if family == "kimi_linear" else DeepseekV3Attention
    hf = _randomize(cls(hf_cfg, layer_idx=0), seed)
    x, cot, positions = _inputs(seed)
    y_ref, dx_ref = _hf_forward_and_grad(hf_cfg, hf, x, cot, positions)

    graphdef, state = nnx.split(_ours(cfg, hf))
    y, dx = _forward_and_grad(graphdef, state, jnp.asarray(x), jnp.asarray(cot), jnp.asarray(positions))
    assert np.abs(y_ref).max() > 0.1  # O(1) outputs, so the absolute tolerance means something
    np.testing.assert_allclose(np.asarray(y), y_ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(dx), dx_ref, atol=ATOL, rtol=0)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _expanded_and_absorbed(graphdef, state, x, positions, q_rows):
    model = nnx.merge(graphdef, state)
    full = model(x, positions)
    c_kv, k_rope = model.latents(x, positions)  # the cache holds every token, future ones too
    lo, hi = q_rows
    chunk = model.attend_latent(x[:, lo:hi], positions[:, lo:hi], c_kv, k_rope, positions)
    last = model.attend_latent(x[:, -1:], positions[:, -1:], c_kv, k_rope, positions)
    return full, chunk, last


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", ["v3_yarn", "kimi_nope"])
def test_absorbed_equals_expanded(case, seed):
    _, q_lora, rope = CASES[case]
    _, cfg = _configs("deepseek_v3", q_lora, rope)
    model = MLA(dataclasses.replace(cfg, init_std=0.3), rngs=nnx.Rngs(seed))
    x, _, positions = _inputs(seed)
    q_rows = (3, 7)  # a query chunk in the middle: the cache is longer and partly in its future
    graphdef, state = nnx.split(model)
    full, chunk, last = _expanded_and_absorbed(graphdef, state, jnp.asarray(x), jnp.asarray(positions), q_rows)
    full = np.asarray(full)
    assert np.abs(full).max() > 0.1
    np.testing.assert_allclose(np.asarray(chunk), full[:, 3:7], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(last), full[:, -1:], atol=ATOL, rtol=0)


def test_param_shapes_and_axes():
    _, cfg = _configs("deepseek_v3", Q, "yarn")
    model = MLA(cfg, rngs=nnx.Rngs(0))
    got = {
        name: (tuple(v.shape), v.axes)
        for name, v in [
            ("q_a", model.q_a),
            ("q_b", model.q_b),
            ("kv_a", model.kv_a),
            ("kv_b", model.kv_b),
            ("o", model.o),
        ]
    }
    assert got == {
        "q_a": ((D, Q), ("embed", "q_latent")),
        "q_b": ((Q, N, NOPE + ROPE), ("q_lora", "heads", "head_dim")),
        "kv_a": ((D, C + ROPE), ("embed", "kv_latent")),
        "kv_b": ((C, N, NOPE + V), ("kv_lora", "heads", "head_dim")),
        "o": ((N, V, D), ("heads", "head_dim", "embed")),
    }


def test_load_errors_name_the_tensor():
    hf_cfg, cfg = _configs("deepseek_v3", Q, "yarn")
    tensors = {k: v.numpy() for k, v in DeepseekV3Attention(hf_cfg, layer_idx=0).state_dict().items()}
    model = MLA(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(CheckpointError, match="'p.kv_b_proj.weight'"):
        load_mla(model, {f"p.{k}": v for k, v in tensors.items() if k != "kv_b_proj.weight"}, "p.")
    with pytest.raises(CheckpointError, match="'o_proj.weight' has shape"):
        load_mla(model, {**tensors, "o_proj.weight": tensors["o_proj.weight"][:, :-1]}, "")
