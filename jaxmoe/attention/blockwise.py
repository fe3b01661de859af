"""Blockwise attention with an online softmax (flash-attention style), in plain ``jnp``.

Queries are processed a block at a time; each query block scans the key blocks, keeping a
running row max ``m``, normaliser ``l`` and weighted sum ``acc``, and skips key blocks that no
query of the block can see (``lax.cond``), so causal prefill does about half the work of the dense
form and never holds a ``[T, S]`` score matrix. Visibility is by position (``kv_pos <= q_pos``),
so the same code serves prefill, chunked prefill against a cache, and (later) ring attention,
whose per-shard partial results merge with :func:`merge_partials`.

Shape letters: B batch, T query length, S key length, N heads, H q/k head dim, V value head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEVER = jnp.iinfo(jnp.int32).max  # position of padded keys: visible to no query


def attention_reference(q, k, v, q_pos, kv_pos, scale: float) -> jax.Array:
    """Dense masked softmax attention; the slow reference for :func:`blockwise_attention`.

    Args:
        q: ``[B, T, N, H]``; k: ``[B, S, N, H]``; v: ``[B, S, N, V]``.
        q_pos: ``[B, T]`` int32; kv_pos: ``[B, S]`` int32. Key s is visible to query t when
            ``kv_pos[s] <= q_pos[t]``; a query that sees nothing gets zeros.
        scale: softmax scale applied to ``q . k``.

    Returns:
        ``[B, T, N, V]`` in ``v``'s dtype.
    """
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) * scale
    visible = (kv_pos[:, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, T, S]
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("BNTS,BSNV->BTNV", probs.astype(v.dtype), v)


def _pad(x: jax.Array, axis: int, multiple: int, value) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _vary_like(x, *likes):
    """``x`` made to vary over every mesh axis any of ``likes`` varies over; identity outside
    ``jax.shard_map``. Inside one, fresh scan/cond carries must match the values they meet."""
    vma = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in likes))
    missing = tuple(sorted(vma - jax.typeof(x).manual_axis_type.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """``[B, L, ...]`` (L a multiple of size) -> ``[L/size, B, size, ...]``."""
    B, L = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, L // size, size, *x.shape[2:]), 1, 0)


def _key_block(carry, block, q, q_pos, scale):
    """One online-softmax update of (m, l, acc) by a key block; skipped if nothing is visible."""
    k, v, kv_pos = block

    def update(carry):
        m, l, acc = carry  # [B, N, T], [B, N, T], [B, N, T, V] fp32
        s = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) * scale
        visible = (kv_pos[:, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, T, S]
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # masked entries: exp(-inf) = 0
        correction = jnp.exp(m - m_safe)  # m = -inf (nothing seen yet): 0
        l = l * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum("BNTS,BSNV->BNTV", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[..., None] + pv

    any_visible = jnp.min(kv_pos) <= jnp.max(q_pos)
    return jax.lax.cond(any_visible, update, lambda c: c, carry), None


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
    *,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """Same contract as :func:`attention_reference`, computed block by block."""
    out, _ = blockwise_partials(q, k, v, q_pos, kv_pos, scale, block_q=block_q, block_k=block_k)
    return out


def blockwise_partials(q, k, v, q_pos, kv_pos, scale, *, block_q=512, block_k=512):
    """Normalised output ``[B, T, N, V]`` and its log-sum-exp ``[B, T, N]`` (fp32, -inf if unseen).

    The pair is what :func:`merge_partials` combines across key shards.
    """
    B, T, N, _ = q.shape
    S, V = k.shape[1], v.shape[-1]
    bq, bk = min(block_q, T), min(block_k, S)
    q_blocks = _blocks(_pad(q, 1, bq, 0), bq)  # [nq, B, bq, N, H]
    q_pos_blocks = _blocks(_pad(q_pos, 1, bq, -1), bq)  # [nq, B, bq]; padding sees nothing
    kv = (
        _blocks(_pad(k, 1, bk, 0), bk),  # [nk, B, bk, N, H]
        _blocks(_pad(v, 1, bk, 0), bk),  # [nk, B, bk, N, V]
        _blocks(_pad(kv_pos, 1, bk, _NEVER), bk),  # [nk, B, bk]
    )

    def query_block(_, xs):
        qb, qpb = xs
        init = (
            jnp.full((B, N, bq), -jnp.inf, jnp.float32),
            jnp.zeros((B, N, bq), jnp.float32),
            jnp.zeros((B, N, bq, V), jnp.float32),
        )
        init = tuple(_vary_like(a, q, k, v, q_pos, kv_pos) for a in init)  # for use inside shard_map
        # Rematerialise each key block's scores in the backward pass: memory O(T), not O(T*S).
        step = jax.checkpoint(lambda c, blk: _key_block(c, blk, qb, qpb, scale))
        (m, l, acc), _ = jax.lax.scan(step, init, kv)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return None, (jnp.moveaxis(out, 1, 2), jnp.moveaxis(lse, 1, 2))  # [B, bq, N, V], [B, bq, N]

    _, (out, lse) = jax.lax.scan(query_block, None, (q_blocks, q_pos_blocks))
    out = jnp.moveaxis(out, 0, 1).reshape(B, -1, N, V)[:, :T]  # [B, T, N, V]
    lse = jnp.moveaxis(lse, 0, 1).reshape(B, -1, N)[:, :T]  # [B, T, N]
    return out.astype(v.dtype), lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combines two attention results over disjoint key sets into the result over their union."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    wa = jnp.exp(lse_a - safe)[..., None]
    wb = jnp.exp(lse_b - safe)[..., None]
    out = out_a.astype(jnp.float32) * wa + out_b.astype(jnp.float32) * wb
    return out.astype(out_a.dtype), lse
