"""The DSA indexer KL loss: against a numpy computation on HF DeepseekV32Attention's attention
weights and index scores, its zero, its sign, and where its gradient goes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch.overrides import TorchFunctionMode
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    DeepseekV32RotaryEmbedding,
)

from jaxmoe.attention.dsa import DSA
from jaxmoe.checkpoint.hf_attention import load_dsa
from jaxmoe.config import IndexerConfig, MLAConfig, ModelConfig
from jaxmoe.train.dsa_loss import indexer_kl_loss, kl_to_target

ATOL = 1e-5
B, T, TOPK = 2, 24, 8
D, N, NOPE, ROPE, V, C, Q = 24, 3, 6, 4, 5, 11, 13
NI, HI = 9, 7

CFG = ModelConfig(
    d_model=D,
    layer_kinds=("dsa",),
    mla=MLAConfig(N, Q, C, NOPE, ROPE, V),
    indexer=IndexerConfig(num_heads=NI, head_dim=HI, topk=TOPK),
)


class _CaptureTopk(TorchFunctionMode):
    """Records HF's indexer top-k input (the index scores) and output indices."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.topk:
            self.scores, self.indices = args[0].detach().numpy(), out.indices.numpy()
        return out


def _hf_reference(seed, *, sparse):
    """HF weights, inputs, and the loss computed in numpy from HF's attention weights and scores."""
    hf_cfg = DeepseekV32Config(
        hidden_size=D, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=Q, kv_lora_rank=C,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, index_n_heads=NI, index_head_dim=HI,
        index_topk=TOPK if sparse else T, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    module = DeepseekV32Attention(hf_cfg, layer_idx=0)
    with torch.no_grad():  # sharper index scores: a loss of O(1), so the tolerance is demanding
        module.indexer.weights_proj.weight.mul_(8.0)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    causal = np.tril(np.ones((T, T), bool))
    with torch.no_grad(), _CaptureTopk() as capture:
        x_t = torch.tensor(x)
        mask = torch.where(torch.tensor(causal), 0.0, torch.finfo(torch.float32).min)[None, None].expand(B, 1, T, T)
        pe = DeepseekV32RotaryEmbedding(hf_cfg)(x_t, torch.tensor(positions, dtype=torch.long))
        _, attn = module(x_t, position_embeddings=pe, attention_mask=mask)  # [B, N, T, S]
    # Keys each query attended to: the indexer's selection (all keys when dense), causal only.
    selected = np.zeros((B, T, T), bool)
    np.put_along_axis(selected, capture.indices.astype(np.int64), True, axis=-1)
    selected &= causal
    target = attn.numpy().astype(np.float64).sum(axis=1) * selected  # [B, T, S]
    target /= target.sum(-1, keepdims=True)
    logits = np.where(selected, capture.scores.astype(np.float64), -np.inf)
    log_q = logits - logits.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    positive = selected & (target > 0)
    kl = np.where(positive, target * (np.log(np.where(positive, target, 1)) - np.where(positive, log_q, 0)), 0)
    tensors = {k: v.numpy() for k, v in module.state_dict().items()}
    return tensors, x, positions, kl.sum(-1).mean()


@functools.partial(jax.jit, static_argnums=(0, 4))
def _loss(graphdef, state, x, positions, sparse):
    return indexer_kl_loss(nnx.merge(graphdef, state), x, positions, sparse=sparse)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_numpy_reference_on_hf(seed, sparse):
    tensors, x, positions, want = _hf_reference(seed, sparse=sparse)
    model = DSA(CFG, rngs=nnx.Rngs(0))
    load_dsa(model, tensors, "")
    graphdef, state = nnx.split(model)
    got = float(_loss(graphdef, state, jnp.asarray(x), jnp.asarray(positions), sparse))
    assert want > 0.1  # a non-trivial loss
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_kl_is_zero_at_the_target_and_positive_elsewhere():
    rng = np.random.default_rng(0)
    mask = rng.random((3, 5, 17)) < 0.6
    mask[..., 0] = True
    target = np.where(mask, rng.random(mask.shape) + 0.01, 0.0)
    target /= target.sum(-1, keepdims=True)
    junk = rng.standard_normal(mask.shape) * 10  # masked-out scores must not matter
    at_target = np.where(mask, np.log(np.where(mask, target, 1.0)) + 3.0, junk)  # softmax is shift-invariant
    kl = kl_to_target(jnp.asarray(target, jnp.float32), jnp.asarray(at_target, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(kl), 0.0, atol=1e-6)
    kl = kl_to_target(jnp.asarray(target, jnp.float32), jnp.asarray(junk, jnp.float32), jnp.asarray(mask))
    assert np.all(np.asarray(kl) > 0)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gradient_reaches_only_the_indexer(sparse):
    model = DSA(dataclasses.replace(CFG, init_std=0.3), rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    @jax.jit
    def grads(params, x):
        def f(params, x):
            return indexer_kl_loss(nnx.merge(graphdef, params, rest), x, positions, sparse=sparse)

        return jax.grad(f, argnums=(0, 1))(params, x)

    g_params, g_x = grads(params, x)
    assert np.all(np.asarray(g_x) == 0)
    flat = {"/".join(map(str, path)): np.asarray(v) for path, v in nnx.to_flat_state(g_params)}
    for name, g in flat.items():
        if name.startswith("indexer/"):
            assert np.abs(g).max() > 0, name
        else:
            assert np.all(g == 0), name
    assert any(name.startswith("indexer/") for name in flat)
