"""Ring MLA: attention over a sequence sharded along the ``context`` mesh axis.

Each shard keeps its queries; the KV *latent* (``c_kv``, ``k_rope`` and their positions, ``C + R``
numbers a token instead of ``N (Hn + Hv)``) travels round the ring with ``ppermute``; each step
expands the visiting block through ``kv_b`` and merges its :func:`blockwise_partials` into the
running result by log-sum-exp. Visibility is by position, so any token layout is correct
(:class:`jaxmoe.attention.mla.MLA` uses the balanced zig-zag layout of
:mod:`jaxmoe.attention.context_parallel`). The backward pass is written out (``custom_vjp``): it
sends the latent round the ring again with its gradient travelling beside it, so a shard holds
O(T/P) activations, not the whole sequence's.

Shape letters: B batch, T query length (global; ``_local`` values hold T/P), S key length, N
heads, Hn nope head dim, V value head dim, C kv latent dim, R rope dim, P shards on ``context``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.attention.blockwise import blockwise_partials, merge_partials
from jaxmoe.attention.context_parallel import (
    CONTEXT,
    check_length,
    context_parallel_size,
    rule_axes,
    token_spec,
    varying_like,
)
from jaxmoe.nn import dense


def _expand_kv(c_kv, k_rope, kv_b, nope_dim: int):
    """Latent ``c_kv[B, S, C]``, ``k_rope[B, S, R]`` -> keys ``[B, S, N, Hn+R]``, values ``[B, S, N, V]``."""
    kv = dense("BSC,CNH->BSNH", c_kv, kv_b)  # [B, S, N, Hn + V]
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    B, S, N, _ = k_nope.shape
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (B, S, N, k_rope.shape[-1]))  # shared by heads
    return jnp.concatenate([k_nope, k_rope], axis=-1), v


def _block_partials(q, c_kv, k_rope, kv_b, q_pos, kv_pos, *, scale, nope_dim, block_q, block_k):
    k, v = _expand_kv(c_kv, k_rope, kv_b, nope_dim)
    return blockwise_partials(q, k, v, q_pos, kv_pos, scale, block_q=block_q, block_k=block_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q, c_kv, k_rope, kv_b, q_pos, kv_pos, static):
    return _ring_fwd(q, c_kv, k_rope, kv_b, q_pos, kv_pos, static)[0]


def _ring_fwd(q, c_kv, k_rope, kv_b, q_pos, kv_pos, static):
    p, kw = static[0], dict(static[1:])
    shift = [(d, (d + 1) % p) for d in range(p)]

    def step(carry, _):
        out, lse, kv = carry
        # Send the block on while this shard works on it; the last step's send is unused.
        nxt = jax.lax.ppermute(kv, CONTEXT, shift)
        out_j, lse_j = _block_partials(q, kv[0], kv[1], kv_b, q_pos, kv[2], **kw)
        out, lse = merge_partials(out, lse, out_j, lse_j)
        return (out, lse, nxt), None

    B, T, N, _ = q.shape
    out0 = varying_like(jnp.zeros((B, T, N, kv_b.shape[-1] - kw["nope_dim"]), q.dtype), q)
    lse0 = varying_like(jnp.full((B, T, N), -jnp.inf, jnp.float32), q)
    (out, lse, _), _ = jax.lax.scan(step, (out0, lse0, (c_kv, k_rope, kv_pos)), length=p)
    return out, (q, c_kv, k_rope, kv_b, q_pos, kv_pos, out, lse)


def _ring_bwd(static, res, g):
    """Blocks visit in the forward order; each block's latent gradient travels with it.

    With ``out = sum_j w_j out_j``, ``w_j = exp(lse_j - lse)``, block j's partials receive
    cotangents ``w_j g`` (output) and ``w_j (<g, out_j> - <g, out>)`` (log-sum-exp).
    """
    p, kw = static[0], dict(static[1:])
    q, c_kv, k_rope, kv_b, q_pos, kv_pos, out, lse = res
    shift = [(d, (d + 1) % p) for d in range(p)]
    g32 = g.astype(jnp.float32)
    g_dot_out = jnp.sum(g32 * out.astype(jnp.float32), axis=-1)  # [B, T, N]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def step(carry, _):
        dq, dkv_b, kv, dkv = carry
        nxt = jax.lax.ppermute(kv, CONTEXT, shift)
        c, r, kp = kv
        fn = functools.partial(_block_partials, q_pos=q_pos, kv_pos=kp, **kw)
        (out_j, lse_j), vjp = jax.vjp(lambda q, c, r, w: fn(q, c, r, w), q, c, r, kv_b)
        w_j = jnp.where(jnp.isfinite(lse_j), jnp.exp(lse_j - lse_safe), 0.0)  # [B, T, N]
        ct_out = (w_j[..., None] * g32).astype(out_j.dtype)
        ct_lse = w_j * (jnp.sum(g32 * out_j.astype(jnp.float32), axis=-1) - g_dot_out)
        dq_j, dc_j, dr_j, dw_j = vjp((ct_out, ct_lse))
        dkv = jax.lax.ppermute((dkv[0] + dc_j, dkv[1] + dr_j), CONTEXT, shift)
        return (dq + dq_j, dkv_b + dw_j, nxt, dkv), None

    zeros = lambda x: varying_like(jnp.zeros(x.shape, x.dtype), x)  # noqa: E731
    init = (zeros(q), zeros(kv_b), (c_kv, k_rope, kv_pos), (zeros(c_kv), zeros(k_rope)))
    # After p steps and p sends, each latent gradient is back on the shard that owns the block.
    (dq, dkv_b, _, (dc, dr)), _ = jax.lax.scan(step, init, length=p)
    return dq, dc, dr, dkv_b, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_mla_attention(
    q: jax.Array,
    c_kv: jax.Array,
    k_rope: jax.Array,
    kv_b: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
    *,
    nope_dim: int,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """MLA (expanded form) over a context-sharded sequence; the ring form of ``blockwise_attention``.

    Args:
        q: ``[B, T, N, Hn+R]`` queries, each head laid out ``[nope, rope]`` (rope already applied).
        c_kv: ``[B, S, C]`` normalised kv latents. k_rope: ``[B, S, R]`` rotated rope keys.
        kv_b: ``[C, N, Hn+V]`` the latent up-projection, ``[k_nope, v]`` per head.
        q_pos: ``[B, T]`` int32, kv_pos: ``[B, S]`` int32 positions; key s is visible to query t
            when ``kv_pos[s] <= q_pos[t]`` (any token order works).
        scale: softmax scale.
        nope_dim: Hn, the nope part of the per-head key.
        block_q, block_k: block sizes of the per-step blockwise attention.

    Returns:
        ``[B, T, N, V]`` in q's dtype; T sharded over ``context`` like ``q``.
    """
    p = context_parallel_size()
    if p == 1:
        raise ValueError("ring_mla_attention needs a mesh (jax.set_mesh) with a 'context' axis of size > 1")
    B, T, N, _ = q.shape
    check_length("q", T, p, "one slice per shard")
    check_length("c_kv", c_kv.shape[1], p, "one slice per shard")
    static = (p, ("scale", scale), ("nope_dim", nope_dim), ("block_q", block_q), ("block_k", block_k))
    kv_b_spec = PartitionSpec(None, rule_axes("act_heads", N), None)

    def body(q, c_kv, k_rope, kv_b, q_pos, kv_pos):
        # kv_b's gradient is a sum over every shard's queries: make it vary like q inside so the
        # shard_map transpose does the sum (psum) over batch and context.
        return _ring(q, c_kv, k_rope, varying_like(kv_b, q), q_pos, kv_pos, static)

    in_specs = (
        token_spec(B, 4, N),
        token_spec(B, 3),
        token_spec(B, 3),
        kv_b_spec,
        token_spec(B, 2),
        token_spec(B, 2),
    )
    fn = jax.shard_map(body, in_specs=in_specs, out_specs=token_spec(B, 4, N))
    return fn(q, c_kv, k_rope, kv_b, q_pos, kv_pos)
