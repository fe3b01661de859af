"""KDA: parity with HF KimiLinearDeltaAttention, chunked == recurrent, state carrying, decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from jaxmoe.attention.kda import KDA, KDAState, chunked_delta_rule, l2norm, recurrent_delta_rule
from jaxmoe.checkpoint.hf_common import CheckpointError
from jaxmoe.checkpoint.hf_kda import load_kda
from jaxmoe.config import KDAConfig, ModelConfig

D, N, H, K, CHUNK, T, B = 24, 3, 8, 4, 16, 37, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg() -> ModelConfig:
    return ModelConfig(
        d_model=D, layer_kinds=("kda",), norm_eps=1e-5, kda=KDAConfig(num_heads=N, head_dim=H, conv_kernel=K, chunk_size=CHUNK)
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
    return {f"layers.0.self_attn.{k}": v.detach().numpy() for k, v in layer.state_dict().items()}


def _ours_from(layer) -> KDA:
    module = KDA(_cfg(), rngs=nnx.Rngs(0))
    load_kda(module, _tensors(layer), "layers.0.self_attn.")
    return module


def _jit(fn):
    """jax.jit over (module state, *args) with the module merged back inside."""

    def wrapped(module, *args):
        graphdef, state = nnx.split(module)
        return jax.jit(lambda s, *a: fn(nnx.merge(graphdef, s), *a))(state, *args)

    return wrapped


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_matches_hf_forward_and_grad(seed):
    layer = _hf_layer(seed)
    module = _ours_from(layer)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    r = rng.standard_normal((B, T, D)).astype(np.float32)

    x_t = torch.tensor(x, requires_grad=True)
    y_t = layer(x_t)
    (y_t * torch.tensor(r)).sum().backward()

    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    y = _jit(lambda m, x: m(x, positions))(module, x)
    dx = _jit(lambda m, x: jax.grad(lambda x: jnp.sum(m(x, positions) * r))(x))(module, x)
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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_equals_recurrent(seed):
    q, k, v, g, beta, s0 = _rule_inputs(seed)
    chunked = jax.jit(chunked_delta_rule, static_argnums=6)
    recurrent = jax.jit(recurrent_delta_rule)
    for init in (None, s0):
        o_c, s_c = chunked(q, k, v, g, beta, init, CHUNK)
        o_r, s_r = recurrent(q, k, v, g, beta, init)
        np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), **TOL)
        np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), **TOL)


def test_chunked_equals_recurrent_gradient():
    q, k, v, g, beta, s0 = _rule_inputs(3)
    r = jax.random.normal(jax.random.key(9), v.shape)

    def loss(rule, *args):
        o, s = rule(*args)
        return jnp.sum(o * r) + jnp.sum(s)

    args = (q, k, v, g, beta, s0)
    grads_c = jax.jit(jax.grad(lambda *a: loss(lambda *b: chunked_delta_rule(*b, CHUNK), *a), argnums=range(6)))(*args)
    grads_r = jax.jit(jax.grad(lambda *a: loss(recurrent_delta_rule, *a), argnums=range(6)))(*args)
    for name, gc, gr in zip("q k v g beta s0".split(), grads_c, grads_r):
        np.testing.assert_allclose(np.asarray(gc), np.asarray(gr), **TOL, err_msg=name)


def test_chunked_stable_under_strong_decay():
    # Cumulative decay over a chunk reaches about -64 * 30: exp of it, or of its negation, is 0 / inf.
    q, k, v, g, beta, s0 = _rule_inputs(4, t=2 * 64 + 5, decay_scale=30.0)
    o_c, s_c = jax.jit(chunked_delta_rule, static_argnums=6)(q, k, v, g, beta, s0, 64)
    o_r, s_r = jax.jit(recurrent_delta_rule)(q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), **TOL)
    np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), **TOL)
    grads = jax.jit(jax.grad(lambda q, g: jnp.sum(chunked_delta_rule(q, k, v, g, beta, s0, 64)[0]), argnums=(0, 1)))(q, g)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in grads)


def test_prefill_in_pieces_and_decode_match_full_forward():
    module = _ours_from(_hf_layer(5))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, D)), jnp.float32)
    fwd = _jit(lambda m, x, s: m.forward_with_state(x, s))
    step = _jit(lambda m, x, s: m.step(x, s))

    y_full, s_full = fwd(module, x, None)
    # Two prefill pieces, neither chunk aligned.
    y1, s1 = fwd(module, x[:, :20], None)
    y2, s2 = fwd(module, x[:, 20:], s1)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), np.asarray(y_full), **TOL)
    for a, b in zip(s2, s_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)

    # Prefill 30 tokens, then decode the rest one at a time, both input layouts.
    y_pre, state = fwd(module, x[:, :30], module.init_state(B))
    assert isinstance(state, KDAState)
    assert state.conv.shape == (B, K - 1, 3, N, H) and state.recurrent.shape == (B, N, H, H)
    ys = [y_pre]
    for t in range(30, T):
        x_t = x[:, t] if t % 2 else x[:, t : t + 1]
        y_t, state = step(module, x_t, state)
        assert y_t.shape == x_t.shape
        ys.append(y_t if y_t.ndim == 3 else y_t[:, None])
    np.testing.assert_allclose(np.concatenate(ys, axis=1), np.asarray(y_full), **TOL)
    for a, b in zip(state, s_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_load_kda_names_missing_tensor():
    tensors = _tensors(_hf_layer(0))
    del tensors["layers.0.self_attn.forget_gate.A_log"]
    with pytest.raises(CheckpointError, match="forget_gate.A_log"):
        load_kda(KDA(_cfg(), rngs=nnx.Rngs(0)), tensors, "layers.0.self_attn.")


def test_init_follows_fla():
    module = KDA(_cfg(), rngs=nnx.Rngs(0))
    a = np.exp(np.asarray(module.A_log[...]))
    dt = np.asarray(jax.nn.softplus(module.dt_bias[...]))
    assert module.A_log[...].shape == (N,) and np.all((a >= 1.0) & (a <= 16.0))
    assert module.dt_bias[...].shape == (N, H) and np.all((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001))
