"""KDA: parity with HF KimiLinearDeltaAttention, chunked == recurrent, state carrying, decode."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from jaxmoe.attention.delta_rule import chunked_delta_rule, recurrent_delta_rule
from jaxmoe.attention.kda import KDA, KDAState, l2norm
from jaxmoe.checkpoint.hf_common import CheckpointError
from jaxmoe.checkpoint.hf_kda import load_kda
from jaxmoe.config import KDAConfig, ModelConfig

D, N, H, K, CHUNK, T, B = 24, 3, 8, 4, 16, 37, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg() -> ModelConfig:
    return ModelConfig(
        d_model=D,
        layer_kinds=("kda",),
        norm_eps=1e-5,
        kda=KDAConfig(num_heads=N, head_dim=H, conv_kernel=K, chunk_size=CHUNK),
    )


def _hf_layer(seed: int) -> KimiLinearDeltaAttention:
    config = KimiLinearConfig(
        hidden_size=D,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_heads=N,
        linear_head_dim=H,
        linear_conv_kernel_dim=K,
        rms_norm_eps=1e-5,
        hidden_act="silu",
    )
    torch.manual_seed(seed)
    layer = KimiLinearDeltaAttention(config, layer_idx=0).float()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log() - 2.0)  # A in [e^-2, 16 e^-2]
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("o_norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.startswith("conv1d"):
                p.copy_(0.5 * torch.randn_like(p))
            else:  # [out, in] projections: unit-scale outputs
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return layer


def _tensors(layer) -> dict[str, np.ndarray]:
    """The layer's tensors in the on-disk layout ``save_pretrained`` writes (split convs, no
    ``forget_gate.`` prefix); transformers fuses and renames them only in memory."""
    out = {}
    for k, v in layer.state_dict().items():
        v = v.detach().numpy()
        if k == "conv1d.weight":
            for stream, part in zip("qkv", np.split(v, 3, axis=0)):
                out[f"layers.0.self_attn.{stream}_conv1d.weight"] = part
            continue
        out[f"layers.0.self_attn.{k.removeprefix('forget_gate.')}"] = v
    return out


@functools.cache
def _blank() -> KDA:
    # Eager init compiles one small program per parameter shape: build once, clone per test.
    return KDA(_cfg(), rngs=nnx.Rngs(0))


def _ours_from(layer) -> KDA:
    module = nnx.clone(_blank())
    load_kda(module, _tensors(layer), "layers.0.self_attn.")
    return module


def _jit(fn):
    """One jax.jit of ``fn(module, *args)``, split into (static graphdef, state) at the boundary."""
    run = jax.jit(lambda graphdef, state, *args: fn(nnx.merge(graphdef, state), *args), static_argnums=0)
    return lambda module, *args: run(*nnx.split(module), *args)


_apply = _jit(lambda m, x, positions: m(x, positions))
_grad_x = _jit(lambda m, x, positions, r: jax.grad(lambda x: jnp.sum(m(x, positions) * r))(x))
_forward_with_state = _jit(lambda m, x, state: m.forward_with_state(x, state))
_step = _jit(lambda m, x, state: m.step(x, state))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_matches_hf_forward_and_grad(seed):
    """Our fp32 layer vs HF's run in float64 (so the oracle adds no rounding of its own).

    ``r`` has variance 1/(T*D) so that the loss, and hence ``dx``, is O(1) and the absolute
    tolerance means what it says; with unit ``r``, ``|dx|`` reaches ~25 and fp32 round-off alone
    (HF's own fp32 run included) is ~1e-4.
    """
    layer = _hf_layer(seed)
    module = _ours_from(layer)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    r = (rng.standard_normal((B, T, D)) / np.sqrt(T * D)).astype(np.float32)

    layer = layer.double()
    x_t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y_t = layer(x_t)
    (y_t * torch.tensor(r, dtype=torch.float64)).sum().backward()

    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    y = _apply(module, x, positions)
    dx = _grad_x(module, x, positions, r)
    np.testing.assert_allclose(np.asarray(y), y_t.detach().numpy(), **TOL)
    np.testing.assert_allclose(np.asarray(dx), x_t.grad.numpy(), **TOL)


def _rule_inputs(seed, t=T, decay_scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 7)
    q = l2norm(jax.random.normal(ks[0], (B, t, N, H))) * H**-0.5
    k = l2norm(jax.random.normal(ks[1], (B, t, N, H)))
    v = jax.random.normal(ks[2], (B, t, N, H))
    g = -decay_scale * jax.nn.softplus(jax.random.normal(ks[3], (B, t, N, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, t, N)))
    s0 = jax.random.normal(ks[5], (B, N, H, H))
    return q, k, v, g, beta, s0


_chunked = jax.jit(chunked_delta_rule, static_argnums=6)
_recurrent = jax.jit(recurrent_delta_rule)


def _rule_grads(rule):
    def loss(q, k, v, g, beta, s0, r):
        o, s = rule(q, k, v, g, beta, s0)
        return jnp.sum(o * r) + jnp.sum(s) / s.size

    return jax.jit(jax.grad(loss, argnums=range(6)))


_chunked_grads = _rule_grads(lambda *a: chunked_delta_rule(*a, CHUNK))
_recurrent_grads = _rule_grads(recurrent_delta_rule)


def _assert_rules_agree(q, k, v, g, beta, s0):
    for init in (None, s0):
        o_c, s_c = _chunked(q, k, v, g, beta, init, CHUNK)
        o_r, s_r = _recurrent(q, k, v, g, beta, init)
        np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), **TOL)
        np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), **TOL)
    r = jax.random.normal(jax.random.key(9), v.shape) / np.sqrt(v.size / B)
    grads_c = _chunked_grads(q, k, v, g, beta, s0, r)
    grads_r = _recurrent_grads(q, k, v, g, beta, s0, r)
    for name, gc, gr in zip("q k v g beta s0".split(), grads_c, grads_r):
        assert bool(jnp.all(jnp.isfinite(gc))), name
        np.testing.assert_allclose(np.asarray(gc), np.asarray(gr), **TOL, err_msg=name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_equals_recurrent(seed):
    """Forward, final state and gradients, from a zero and from a random initial state."""
    _assert_rules_agree(*_rule_inputs(seed))


def test_chunked_stable_under_strong_decay():
    # Per-token log-decay ~ -20: across a 16-token chunk exp(+-G) would over/underflow fp32.
    _assert_rules_agree(*_rule_inputs(4, decay_scale=30.0))


def test_prefill_in_pieces_and_decode_match_full_forward():
    module = _ours_from(_hf_layer(5))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, D)), jnp.float32)
    fwd, step = _forward_with_state, _step
    state0 = module.init_state(B)
    assert isinstance(state0, KDAState)
    assert state0.conv.shape == (B, K - 1, 3, N, H) and state0.recurrent.shape == (B, N, H, H)

    y_full, s_full = fwd(module, x, state0)
    # Three prefill pieces, none chunk aligned, one shorter than the conv window.
    y1, s1 = fwd(module, x[:, :20], state0)
    y2, s2 = fwd(module, x[:, 20:22], s1)
    y3, s3 = fwd(module, x[:, 22:], s2)
    np.testing.assert_allclose(np.concatenate([y1, y2, y3], axis=1), np.asarray(y_full), **TOL)
    for a, b in zip(s3, s_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)

    # After the 20-token prefill, decode the rest one token at a time, both input layouts.
    ys, state = [y1], s1
    for t in range(20, T):
        x_t = x[:, t] if t % 2 else x[:, t : t + 1]
        y_t, state = step(module, x_t, state)
        assert y_t.shape == x_t.shape
        ys.append(y_t if y_t.ndim == 3 else y_t[:, None])
    np.testing.assert_allclose(np.concatenate(ys, axis=1), np.asarray(y_full), **TOL)
    for a, b in zip(state, s_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_load_kda_names_missing_tensor():
    tensors = _tensors(_hf_layer(0))
    del tensors["layers.0.self_attn.A_log"]
    with pytest.raises(CheckpointError, match="self_attn.A_log"):
        load_kda(nnx.clone(_blank()), tensors, "layers.0.self_attn.")


def test_init_follows_fla():
    module = _blank()
    a = np.exp(np.asarray(module.A_log[...]))
    dt = np.asarray(jax.nn.softplus(module.dt_bias[...]))
    assert module.A_log[...].shape == (N,) and np.all((a >= 1.0) & (a <= 16.0))
    assert module.dt_bias[...].shape == (N, H) and np.all((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001))
