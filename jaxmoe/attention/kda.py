"""Kimi Delta Attention (KDA): a gated delta-rule linear attention with per-channel decay.

The delta rule itself (per head a state ``S[H, V]``, decayed, written and read once a token) is in
:mod:`jaxmoe.attention.delta_rule`: :func:`recurrent_delta_rule` for decode,
:func:`chunked_delta_rule` for training and prefill. Under a mesh whose ``context`` axis is larger
than one device the layer runs the conv and the rule of :mod:`jaxmoe.attention.kda_context` instead.

Around the delta rule (HF ``KimiLinearDeltaAttention``): q, k, v projections, each through a short
causal depthwise conv and SiLU; q and k L2-normalised, q scaled by ``H**-0.5``; forget gate
``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``; ``beta = sigmoid(b(x))``; the output goes
through a gated RMSNorm ``norm(o) * sigmoid(g_b(g_a(x)))`` and the ``o`` projection.

Shape letters: B batch, T sequence, D model dim, N heads, H key head dim, V value head dim (equal
to H; its own letter so the state ``[H, V]`` reads keys x values), K conv kernel, Q the three conv
streams (q, k, v).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.attention.context_parallel import context_parallel_size
from jaxmoe.attention.delta_rule import chunked_delta_rule, recurrent_delta_rule
from jaxmoe.attention.kda_context import context_parallel_conv, context_parallel_delta_rule
from jaxmoe.config import ModelConfig
from jaxmoe.nn import dense, param, rms_norm
from jaxmoe.nn.linear import normal, ones
from jaxmoe.sharding import constrain


class KDAState(NamedTuple):
    """What a KDA layer carries between calls: O(1) in the sequence length.

    Attributes:
      conv: ``[B, K-1, 3, N, H]`` the last K-1 pre-conv q, k, v projections (compute dtype).
      recurrent: ``[B, N, H, V]`` float32, the delta-rule state ``S[dk, dv]`` as in HF.
    """

    conv: jax.Array
    recurrent: jax.Array


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (FLA's l2norm: eps inside the root)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# --------------------------------------------------------------------------------------------
# The layer


def short_conv(
    x: jax.Array, w: jax.Array, conv_state: jax.Array, lengths: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv (before the SiLU) continuing from ``conv_state``.

    Args:
      x: ``[B, T, ...]`` inputs. w: ``[K, ...]`` taps, tap K-1 multiplies the current token (as
        torch conv1d). conv_state: ``[B, K-1, ...]`` the K-1 inputs before ``x``.
      lengths: optional ``[B]`` int32: row ``b`` holds ``lengths[b]`` real tokens, the rest is
        padding (whose outputs are garbage and which the returned state does not include).

    Returns:
      ``y [B, T, ...]`` and the last K-1 inputs ``[B, K-1, ...]`` (the next conv state).
    """
    t, kw = x.shape[1], w.shape[0]
    xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, ...]
    y = sum(xp[:, j : j + t] * w[j] for j in range(kw))
    if lengths is None:
        return y, xp[:, t:]
    # The K-1 inputs that end at the last real token: xp[lengths : lengths + K-1].
    idx = lengths[:, None] + jnp.arange(kw - 1, dtype=lengths.dtype)[None]  # [B, K-1]
    return y, jnp.take_along_axis(xp, idx.reshape(idx.shape + (1,) * (xp.ndim - 2)), axis=1)


def _a_log_init(key, shape, dtype):
    # FLA: A ~ U(1, 16), stored as log A.
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype):
    # FLA: dt = exp(U(log 1e-3, log 1e-1)) >= 1e-4, stored as softplus^-1(dt).
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDA(nnx.Module):
    """Kimi delta attention layer (HF ``KimiLinearDeltaAttention``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        kc = cfg.kda
        d, n, h, kw = cfg.d_model, kc.num_heads, kc.head_dim, kc.conv_kernel
        self.num_heads, self.head_dim, self.conv_kernel = n, h, kw
        self.chunk_size = kc.chunk_size
        self.eps = cfg.norm_eps
        self.dtype = jnp.dtype(cfg.dtype)
        pd = jnp.dtype(cfg.param_dtype)
        init = normal(cfg.init_std)

        self.q = param(rngs, (d, n, h), ('embed', 'heads', 'head_dim'), init, pd)
        self.k = param(rngs, (d, n, h), ('embed', 'heads', 'head_dim'), init, pd)
        self.v = param(rngs, (d, n, h), ('embed', 'heads', 'head_dim'), init, pd)
        self.q_conv = param(rngs, (kw, n, h), ('conv', 'heads', 'head_dim'), init, pd)
        self.k_conv = param(rngs, (kw, n, h), ('conv', 'heads', 'head_dim'), init, pd)
        self.v_conv = param(rngs, (kw, n, h), ('conv', 'heads', 'head_dim'), init, pd)
        # Forget gate; A_log and dt_bias stay float32 (HF keeps dt_bias in fp32 strictly).
        self.f_a = param(rngs, (d, h), ('embed', 'head_dim'), init, pd)
        self.f_b = param(rngs, (h, n, h), ('head_dim', 'heads', 'head_dim'), init, pd)
        self.dt_bias = param(rngs, (n, h), ('heads', 'head_dim'), _dt_bias_init, jnp.float32)
        self.A_log = param(rngs, (n,), ('heads',), _a_log_init, jnp.float32)
        self.b = param(rngs, (d, n), ('embed', 'heads'), init, pd)
        # Output gate, gated RMSNorm, output projection.
        self.g_a = param(rngs, (d, h), ('embed', 'head_dim'), init, pd)
        self.g_b = param(rngs, (h, n, h), ('head_dim', 'heads', 'head_dim'), init, pd)
        self.o_norm = param(rngs, (h,), ('norm',), ones, pd)
        self.o = param(rngs, (n, h, d), ('heads', 'head_dim', 'embed'), init, pd)

    def init_state(self, batch_size: int) -> KDAState:
        """Zero state: what a sequence starts from."""
        n, h, kw = self.num_heads, self.head_dim, self.conv_kernel
        return KDAState(
            conv=jnp.zeros((batch_size, kw - 1, 3, n, h), self.dtype),
            recurrent=jnp.zeros((batch_size, n, h, h), jnp.float32),
        )

    def _conv(
        self, x: jax.Array, conv_state: jax.Array, context_parallel: bool = False, lengths: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """q, k, v projections through the causal depthwise convs and SiLU.

        Returns ``[B, T, 3, N, H]`` and the new conv state ``[B, K-1, 3, N, H]``. With
        ``context_parallel`` the sequence is split over the ``context`` mesh axis and each shard
        takes its halo from the previous one. ``lengths`` as :func:`short_conv`.
        """
        with jax.named_scope('qkv'):
            qkv = jnp.stack([dense('BTD,DNH->BTNH', x, w) for w in (self.q, self.k, self.v)], axis=2)
        with jax.named_scope('short_conv'):
            w = jnp.stack([self.q_conv[...], self.k_conv[...], self.v_conv[...]], axis=1)  # [K, 3, N, H]
            w = w.astype(qkv.dtype)
            if context_parallel:
                y, conv_state = context_parallel_conv(qkv, w, conv_state, short_conv)
            else:
                y, conv_state = short_conv(qkv, w, conv_state, lengths)
        return jax.nn.silu(y), conv_state

    def _inputs(self, x: jax.Array, state: KDAState, context_parallel: bool = False, lengths: jax.Array | None = None):
        """Everything the delta rule reads, and the new conv state.

        With ``lengths [B]``, tokens at or past ``lengths[b]`` are padding: their decay and write
        strength are zero, so the delta-rule state after the row is the state after its last real token.
        """
        x = x.astype(self.dtype)
        qkv, conv_state = self._conv(x, state.conv, context_parallel, lengths)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, N, H] each
        # FLA normalises in fp32.
        q = l2norm(q.astype(jnp.float32)) * self.head_dim**-0.5
        k = l2norm(k.astype(jnp.float32))
        # The whole sequence on each device for the local scan; split over 'context' for the CP one.
        seq = 'seq' if context_parallel else None
        q, k, v = (constrain(a, ('batch', seq, 'act_heads', None)) for a in (q, k, v))
        with jax.named_scope('gates'):
            f = dense('BTH,HNG->BTNG', dense('BTD,DH->BTH', x, self.f_a), self.f_b)
            f = f.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
            g = -jnp.exp(self.A_log[...].astype(jnp.float32))[:, None] * jax.nn.softplus(f)  # [B, T, N, H]
            beta = jax.nn.sigmoid(dense('BTD,DN->BTN', x, self.b).astype(jnp.float32))
        if lengths is not None:
            real = jnp.arange(x.shape[1])[None] < lengths[:, None]  # [B, T]
            g = jnp.where(real[:, :, None, None], g, 0.0)
            beta = jnp.where(real[:, :, None], beta, 0.0)
        return (q, k, v, g, beta), conv_state

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """Gated RMSNorm over each head (fp32, as HF) and the output projection."""
        x = x.astype(self.dtype)
        with jax.named_scope('output'):
            gate = dense('BTH,HNG->BTNG', dense('BTD,DH->BTH', x, self.g_a), self.g_b)
            o = rms_norm(o.astype(jnp.float32), self.o_norm[...].astype(jnp.float32), self.eps)
            o = (o * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
            return dense('BTNH,NHD->BTD', o, self.o)

    def forward_with_state(
        self, x: jax.Array, state: KDAState | None = None, lengths: jax.Array | None = None
    ) -> tuple[jax.Array, KDAState]:
        """Chunked forward that starts from ``state`` and returns the state after ``x``.

        Args:
          x: ``[B, T, D]``.
          state: a :class:`KDAState` for batch B, or None (zeros: the start of a sequence).
          lengths: optional ``[B]`` int32 real tokens per row (the inference engine's padded
            prefill chunks); the returned state is the one after each row's last real token.

        Returns:
          ``y [B, T, D]`` in the compute dtype, and the state after the last token.

        With a mesh whose ``context`` axis has size P > 1 the sequence is split over it (T a
        multiple of P, at least ``conv_kernel - 1`` tokens a shard) and the result is the same.
        Padded rows (``lengths``: the engine's prefill chunks, a few hundred tokens) are never
        split: each device scans its rows' whole chunk, whatever the mesh.
        """
        state = self.init_state(x.shape[0]) if state is None else state
        with jax.named_scope('kda'):
            if lengths is None and context_parallel_size() > 1:
                (q, k, v, g, beta), conv_state = self._inputs(x, state, context_parallel=True)
                rule = context_parallel_delta_rule
            else:
                (q, k, v, g, beta), conv_state = self._inputs(x, state, lengths=lengths)
                rule = chunked_delta_rule
            o, recurrent = rule(q, k, v, g, beta, state.recurrent, self.chunk_size)
            return self._output(o, x), KDAState(conv_state, recurrent)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x [B, T, D]`` -> ``y [B, T, D]`` from a zero state (``positions`` is unused)."""
        del positions  # KDA is position-free: order enters through the conv and the decay.
        return self.forward_with_state(x)[0]

    def step(self, x_t: jax.Array, state: KDAState) -> tuple[jax.Array, KDAState]:
        """One decode token with the recurrent form.

        Args:
          x_t: ``[B, 1, D]`` or ``[B, D]``.
          state: the :class:`KDAState` after the previous tokens.

        Returns:
          ``y_t`` shaped like ``x_t``, and the updated state.
        """
        squeeze = x_t.ndim == 2
        x = x_t[:, None] if squeeze else x_t  # [B, 1, D]
        with jax.named_scope('kda_step'):
            (q, k, v, g, beta), conv_state = self._inputs(x, state)
            o, recurrent = recurrent_delta_rule(q, k, v, g, beta, state.recurrent)
            y = self._output(o, x)
        return (y[:, 0] if squeeze else y), KDAState(conv_state, recurrent)
