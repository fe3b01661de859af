"""The gated delta rule with per-channel decay (the kernel of KDA), recurrent and chunked.

Per head the rule keeps a state ``S[H, V]`` (keys x values) and, for every token,

    S <- S * exp(g)[:, None]          (g: per key channel log-decay, <= 0)
    delta = beta * (v - S^T k)         (beta in (0, 1): write strength)
    S <- S + k delta^T
    o = S^T q

:func:`recurrent_delta_rule` runs exactly that, one token at a time (decode; the reference).
:func:`chunked_delta_rule` gives the same result a chunk at a time (training and prefill): inside
a chunk the writes are solved for at once with the WY/UT representation (a unit lower-triangular
solve), and only the state crosses chunk boundaries (a ``jax.lax.scan``). Decays inside a chunk
are cumulative log-sums; only differences ``G[t] - G[s]`` with ``s <= t`` (never positive) are
exponentiated, so nothing overflows however long the sequence. The layer around it is
:class:`jaxmoe.attention.kda.KDA`; the context-parallel form is
:func:`jaxmoe.attention.kda_context.context_parallel_delta_rule`.

Shape letters: B batch, T sequence (inside a chunk: query position), S key position inside a
chunk, N heads, H key head dim, V value head dim, C number of chunks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


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
