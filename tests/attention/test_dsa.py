"""DSA against HF DeepseekV32Attention: indexer scores, selected index sets, output and input
gradient, with top-k smaller than the sequence so the selection really is sparse."""

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
from jaxmoe.attention.mla import MLA
from jaxmoe.checkpoint.hf_attention import load_dsa, load_mla
from jaxmoe.config import IndexerConfig, MLAConfig, ModelConfig, RopeConfig

ATOL = 1e-5
B, T, TOPK = 2, 40, 16
D, N, NOPE, ROPE, V, C, Q = 24, 3, 6, 4, 5, 11, 13
NI, HI = 9, 7  # enough indexer heads that all-ReLU-zero ties are rare
YARN = dict(factor=4.0, original_max_position=16, beta_fast=32.0, beta_slow=1.0, mscale=0.7, mscale_all_dim=1.0)


def _configs(topk=TOPK):
    hf = DeepseekV32Config(
        hidden_size=D, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=Q, kv_lora_rank=C,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, index_topk=topk, index_head_dim=HI,
        index_n_heads=NI, max_position_embeddings=128, attn_implementation="eager",
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": YARN["factor"],
            "original_max_position_embeddings": YARN["original_max_position"],
            **{k: YARN[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")},
        },
    )  # fmt: skip
    ours = ModelConfig(
        d_model=D,
        layer_kinds=("dsa",),
        mla=MLAConfig(N, Q, C, NOPE, ROPE, V),
        indexer=IndexerConfig(num_heads=NI, head_dim=HI, topk=topk),
        rope=RopeConfig(type="yarn", **YARN),
    )
    return hf, ours


class _CaptureTopkInput(TorchFunctionMode):
    """Records HF's indexer top-k: its input (the index scores, which HF never returns) and indices."""

    scores = indices = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.topk:
            self.scores, self.indices = args[0].detach().clone(), out.indices.detach().clone()
        return out


def _hf_run(seed, topk=TOPK):
    """HF module with random weights, its output, input gradient, index scores and indices."""
    hf_cfg, cfg = _configs(topk)
    torch.manual_seed(seed)
    module = DeepseekV32Attention(hf_cfg, layer_idx=0)
    for name, p in module.named_parameters():
        if "norm" in name:  # norms start at ones / zeros: perturb them so a mix-up would show
            p.data = (0.0 if name.endswith("bias") else 1.0) + 0.3 * torch.randn_like(p)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    cot = rng.standard_normal((B, T, D)).astype(np.float32)
    positions = (np.arange(T)[None, :] + np.array([[0], [5]])).astype(np.int32)

    x_t = torch.tensor(x, requires_grad=True)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    pe = DeepseekV32RotaryEmbedding(hf_cfg)(x_t, torch.tensor(positions, dtype=torch.long))
    capture = _CaptureTopkInput()
    with capture:
        y = module(x_t, position_embeddings=pe, attention_mask=mask)[0]
    (y * torch.tensor(cot)).sum().backward()
    ref = dict(y=y.detach().numpy(), dx=x_t.grad.numpy(), scores=capture.scores.numpy())
    ref["indices"] = capture.indices.numpy()
    tensors = {k: v.numpy() for k, v in module.state_dict().items()}
    return cfg, tensors, (x, cot, positions), ref


@functools.partial(jax.jit, static_argnums=0)
def _run(graphdef, state, x, cot, positions):
    model = nnx.merge(graphdef, state)
    scores = model.indexer(x, model.query_latent(x), positions)
    indices, valid = model.indexer.select(scores, positions)
    y, vjp = jax.vjp(lambda x: nnx.merge(graphdef, state)(x, positions), x)
    dense = MLA.__call__(model, x, positions)  # same weights, every causal key
    return dict(scores=scores, indices=indices, valid=valid, y=y, dx=vjp(cot)[0], dense=dense)


def _ours(cfg, tensors, inputs):
    model = DSA(cfg, rngs=nnx.Rngs(0))
    load_dsa(model, tensors, "")
    graphdef, state = nnx.split(model)
    return jax.tree.map(np.asarray, _run(graphdef, state, *map(jnp.asarray, inputs)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_hf(seed):
    cfg, tensors, inputs, ref = _hf_run(seed)
    got = _ours(cfg, tensors, inputs)
    causal = np.tril(np.ones((T, T), bool))

    # Index scores on causal entries; ours hold -inf elsewhere.
    np.testing.assert_allclose(got["scores"][:, causal], ref["scores"][:, causal], atol=ATOL, rtol=0)
    assert np.all(got["scores"][:, ~causal] == -np.inf)

    # The selected sets. HF's top-k also returns masked future entries for early queries; its
    # causal mask drops them, as our validity mask does. Compare causal selections as sets.
    hf_indices = ref["indices"]  # [B, T, K]
    for b in range(B):
        for t in range(T):
            if t + 1 > TOPK:  # a tie at the top-k boundary would make the comparison meaningless
                kth, next_ = np.sort(ref["scores"][b, t, : t + 1])[::-1][TOPK - 1 : TOPK + 1]
                assert kth - next_ > 1e-6, f"seed {seed} has a top-k tie at query {(b, t)}: pick another"
            want = {int(s) for s in hf_indices[b, t] if s <= t}
            have = {int(s) for s, ok in zip(got["indices"][b, t], got["valid"][b, t]) if ok}
            assert have == want, (b, t)
            assert len(have) == min(t + 1, TOPK)

    assert np.abs(ref["y"]).max() > 0.1
    np.testing.assert_allclose(got["y"], ref["y"], atol=ATOL, rtol=0)
    assert np.abs(got["dense"] - ref["y"]).max() > 1e-2  # the sparsity is visible in the output
    np.testing.assert_allclose(got["dx"], ref["dx"], atol=ATOL, rtol=0)


def test_topk_covering_everything_is_dense_mla():
    cfg, tensors, (x, cot, positions), _ = _hf_run(0)
    cfg = ModelConfig(**{**cfg.__dict__, "indexer": IndexerConfig(num_heads=NI, head_dim=HI, topk=T + 3)})
    dsa, mla = DSA(cfg, rngs=nnx.Rngs(0)), MLA(cfg, rngs=nnx.Rngs(0))
    load_dsa(dsa, tensors, "")
    load_mla(mla, tensors, "")
    x, positions = jnp.asarray(x), jnp.asarray(positions)
    y_sparse = jax.jit(lambda m, x, p: m(x, p))(dsa, x, positions)
    y_dense = jax.jit(lambda m, x, p: m(x, p))(mla, x, positions)
    np.testing.assert_allclose(np.asarray(y_sparse), np.asarray(y_dense), atol=ATOL, rtol=0)


def test_indexer_param_shapes_and_axes():
    _, cfg = _configs()
    ix = DSA(cfg, rngs=nnx.Rngs(0)).indexer
    got = {name: (tuple(getattr(ix, name).shape), getattr(ix, name).axes) for name in ("wq_b", "wk", "weights_proj")}
    assert got == {
        "wq_b": ((Q, NI, HI), ("q_lora", "heads", "head_dim")),
        "wk": ((D, HI), ("embed", "head_dim")),
        "weights_proj": ((D, NI), ("embed", "heads")),
    }
    assert ix.k_norm.weight.shape == (HI,) and ix.k_norm.bias.shape == (HI,)
