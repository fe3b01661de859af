"""Kimi Delta Attention (KDA): a gated delta-rule linear attention with per-channel decay.

Per head the layer keeps a state ``S[H, V]`` (keys x values) and, for every token,

    S <- S * exp(g)[:, None]          (g: per key channel log-decay, <= 0)
    delta = beta * (v - S^T k)         (beta in (0, 1): write strength)
    S <- S + k delta^T
    o = S^T q

:func:`recurrent_delta_rule` runs exactly that, one token at a time (decode).
:func:`chunked_delta_rule` gives the same result a chunk at a time (training and prefill): inside
a chunk the writes are solved for at once with the WY/UT representation (a unit lower-triangular
solve), and only the state crosses chunk boundaries (a ``jax.lax.scan``). Decays inside a chunk
are cumulative log-sums; only differences ``G[t] - G[s]`` with ``s <= t`` (never positive) are
exponentiated, so nothing overflows however long the sequence.

Around the delta rule (HF ``KimiLinearDeltaAttention``): q, k, v projections, each through a short
causal depthwise conv and SiLU; q and k L2-normalised, q scaled by ``H**-0.5``; forget gate
``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``; ``beta = sigmoid(b(x))``; the output goes
through a gated RMSNorm ``norm(o) * sigmoid(g_b(g_a(x)))`` and the ``o`` projection.

Shape letters: B batch, T sequence (inside a chunk: query position), S key position inside a
chunk, D model dim, N heads, H key head dim, V value head dim (equal to H; its own letter so the
state ``[H, V]`` reads keys x values), K conv kernel, C number of chunks, Q the three conv streams
(q, k, v).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.attention import context_parallel as cp
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
# The delta rule: recurrent (reference, decode) and chunked (training, prefill)


def _zeros_state(k: jax.Array, v: jax.Array) -> jax.Array:
    b, _, n, h = k.shape
    return jnp.zeros((b, n, h, v.shape[-1]), jnp.float32)


def recurrent_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time.

    Args:
      q: ``[B, T, N, H]`` queries (already normalised and scaled; no scale is applied here).
      k: ``[B, T, N, H]`` keys.
      v: ``[B, T, N, V]`` values.
      g: ``[B, T, N, H]`` per channel log-decay (<= 0).
      beta: ``[B, T, N]`` write strength.
      initial_state: ``[B, N, H, V]`` or None (zeros).

    Returns:
      ``o [B, T, N, V]`` in q's dtype and the final state ``[B, N, H, V]`` float32.
    """
    dtype = q.dtype
    state = _zeros_state(k, v) if initial_state is None else initial_state.astype(jnp.float32)
    # Time leading for the scan: [B, T, ...] -> [T, B, ...].
    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta))

    def token(s, x):
        q_t, k_t, v_t, g_t, beta_t = x  # [B, N, H] x4, [B, N]
        s = s * jnp.exp(g_t)[..., None]
        delta = beta_t[..., None] * (v_t - jnp.einsum('BNHV,BNH->BNV', s, k_t))
        s = s + jnp.einsum('BNH,BNV->BNHV', k_t, delta)
        return s, jnp.einsum('BNHV,BNH->BNV', s, q_t)

    with jax.named_scope('kda_recurrent'):
        state, o = jax.lax.scan(token, state, xs)
    return jnp.moveaxis(o, 0, 1).astype(dtype), state


def _solve_unit_lower(strict: jax.Array, b: jax.Array) -> jax.Array:
    """Solves ``(I + strict) x = b`` by forward substitution: ``strict[..., T, T]`` strictly lower.

    Not ``jax.scipy.linalg.solve_triangular``: jaxlib's LAPACK trsm kernel splits its batch over
    XLA's intra-op thread pool and blocks on it, which deadlocks with 8 CPU devices running at
    once (every pool thread ends up waiting). The arithmetic is the same, row by row.
    """

    def row(i, x):  # x[i] = b[i] - sum_{s < i} strict[i, s] x[s]
        return x.at[..., i, :].set(b[..., i, :] - jnp.einsum("...S,...SM->...M", strict[..., i, :], x))

    return jax.lax.fori_loop(0, strict.shape[-1], row, jnp.zeros_like(b))


def _chunk(state: jax.Array, x) -> tuple[jax.Array, jax.Array]:
    """One chunk of the delta rule in WY/UT form; ``state [B, N, H, V]`` in, out.

    ``x`` holds ``q, k [B, T, N, H]``, ``v [B, T, N, V]``, the in-chunk cumulative log-decay
    ``G [B, T, N, H]`` (G[t] = sum of g up to and including t) and ``beta [B, T, N]``.
    """
    q, k, v, G, beta = x
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))  # [T, S]: s <= t
    strict = jnp.tril(jnp.ones((t, t), bool), -1)  # [T, S]: s < t

    # exp(G[t] - G[s]) only where s <= t: the masked differences would be positive.
    diff = G[:, :, None] - G[:, None, :]  # [B, T, S, N, H]
    decay = jnp.exp(jnp.where(causal[None, :, :, None, None], diff, -jnp.inf))

    k_beta = k * beta[..., None]
    # Writes of earlier tokens seen by later keys, and by queries (diagonal included).
    kk = jnp.einsum('BTNH,BSNH,BTSNH->BNTS', k_beta, k, decay) * strict
    qk = jnp.einsum('BTNH,BSNH,BTSNH->BNTS', q, k, decay) * causal

    # UT transform: (I + kk) [u, w] = [beta v, beta k exp(G)], unit lower triangular.
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(G)], axis=-1)  # [B, T, N, V+H]
    rhs = jnp.swapaxes(rhs, 1, 2)  # [B, N, T, V+H]
    sol = _solve_unit_lower(kk, rhs)
    u, w = sol[..., : v.shape[-1]], sol[..., v.shape[-1] :]  # [B, N, T, V], [B, N, T, H]

    # Pseudo-values: what each token writes once the incoming state's prediction is removed.
    v_new = u - jnp.einsum('BNTH,BNHV->BNTV', w, state)
    o = jnp.einsum('BTNH,BNHV->BTNV', q * jnp.exp(G), state)
    o = o + jnp.einsum('BNTS,BNSV->BTNV', qk, v_new)

    g_last = G[:, -1]  # [B, N, H]
    k_to_end = k * jnp.exp(g_last[:, None] - G)  # [B, T, N, H]
    state = state * jnp.exp(g_last)[..., None] + jnp.einsum('BSNH,BNSV->BNHV', k_to_end, v_new)
    return state, o


def chunked_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule a chunk at a time; equal to :func:`recurrent_delta_rule`.

    Args and returns as :func:`recurrent_delta_rule`. ``T`` need not be a multiple of
    ``chunk_size``: the tail is padded with tokens that neither decay nor write. The chunk body
    is rematerialised in the backward pass, so activation memory stays O(T) rather than
    O(T * chunk_size).
    """
    dtype = q.dtype
    b, t, n, h = k.shape
    state = _zeros_state(k, v) if initial_state is None else initial_state.astype(jnp.float32)
    c = max(1, math.ceil(t / chunk_size))
    pad = c * chunk_size - t

    def chunks(a):
        a = a.astype(jnp.float32)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, c, chunk_size, *a.shape[2:])  # [B, C, T, ...]
        return jnp.moveaxis(a, 1, 0)  # [C, B, T, ...]

    q_c, k_c, v_c, g_c, beta_c = (chunks(a) for a in (q, k, v, g, beta))
    G_c = jnp.cumsum(g_c, axis=2)  # [C, B, T, N, H] in-chunk cumulative log-decay

    with jax.named_scope('kda_chunked'):
        state, o = jax.lax.scan(jax.checkpoint(_chunk), state, (q_c, k_c, v_c, G_c, beta_c))
    o = jnp.moveaxis(o, 0, 1).reshape(b, c * chunk_size, n, v.shape[-1])  # [B, C*T, N, V]
    return o[:, :t].astype(dtype), state


# --------------------------------------------------------------------------------------------
# The layer


def short_conv(x: jax.Array, w: jax.Array, conv_state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv (before the SiLU) continuing from ``conv_state``.

    Args:
      x: ``[B, T, ...]`` inputs. w: ``[K, ...]`` taps, tap K-1 multiplies the current token (as
        torch conv1d). conv_state: ``[B, K-1, ...]`` the K-1 inputs before ``x``.

    Returns:
      ``y [B, T, ...]`` and the last K-1 inputs ``[B, K-1, ...]`` (the next conv state).
    """
    t, kw = x.shape[1], w.shape[0]
    xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, ...]
    y = sum(xp[:, j : j + t] * w[j] for j in range(kw))
    return y, xp[:, t:]


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

    def _conv(self, x: jax.Array, conv_state: jax.Array, context_parallel: bool = False) -> tuple[jax.Array, jax.Array]:
        """q, k, v projections through the causal depthwise convs and SiLU.

        Returns ``[B, T, 3, N, H]`` and the new conv state ``[B, K-1, 3, N, H]``. With
        ``context_parallel`` the sequence is split over the ``context`` mesh axis and each shard
        takes its halo from the previous one.
        """
        with jax.named_scope('qkv'):
            qkv = jnp.stack([dense('BTD,DNH->BTNH', x, w) for w in (self.q, self.k, self.v)], axis=2)
        with jax.named_scope('short_conv'):
            w = jnp.stack([self.q_conv[...], self.k_conv[...], self.v_conv[...]], axis=1)  # [K, 3, N, H]
            w = w.astype(qkv.dtype)
            if context_parallel:
                y, conv_state = cp.context_parallel_conv(qkv, w, conv_state, short_conv)
            else:
                y, conv_state = short_conv(qkv, w, conv_state)
        return jax.nn.silu(y), conv_state

    def _inputs(self, x: jax.Array, state: KDAState, context_parallel: bool = False):
        """Everything the delta rule reads, and the new conv state."""
        x = x.astype(self.dtype)
        qkv, conv_state = self._conv(x, state.conv, context_parallel)
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
        return (q, k, v, g, beta), conv_state

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """Gated RMSNorm over each head (fp32, as HF) and the output projection."""
        x = x.astype(self.dtype)
        with jax.named_scope('output'):
            gate = dense('BTH,HNG->BTNG', dense('BTD,DH->BTH', x, self.g_a), self.g_b)
            o = rms_norm(o.astype(jnp.float32), self.o_norm[...].astype(jnp.float32), self.eps)
            o = (o * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
            return dense('BTNH,NHD->BTD', o, self.o)

    def forward_with_state(self, x: jax.Array, state: KDAState | None = None) -> tuple[jax.Array, KDAState]:
        """Chunked forward that starts from ``state`` and returns the state after ``x``.

        Args:
          x: ``[B, T, D]``.
          state: a :class:`KDAState` for batch B, or None (zeros: the start of a sequence).

        Returns:
          ``y [B, T, D]`` in the compute dtype, and the state after the last token.

        With a mesh whose ``context`` axis has size P > 1 the sequence is split over it (T a
        multiple of P, at least ``conv_kernel - 1`` tokens a shard) and the result is the same.
        """
        state = self.init_state(x.shape[0]) if state is None else state
        with jax.named_scope('kda'):
            if cp.context_parallel_size() > 1:
                (q, k, v, g, beta), conv_state = self._inputs(x, state, context_parallel=True)
                rule = cp.context_parallel_delta_rule
            else:
                (q, k, v, g, beta), conv_state = self._inputs(x, state)
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
