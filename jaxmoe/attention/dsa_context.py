"""DeepSeek sparse attention without ``[T, S]`` arrays: blockwise and context-parallel.

The dense DSA path (:meth:`jaxmoe.attention.dsa.DSA.select` then ``sparse_attention``) scores
every query against every key, ``[B, T, S]``, and gathers ``[B, T, K, C]``; both grow past any
memory long before a 1M-token context. :func:`sparse_dsa` computes the same result with memory
``O(query_chunk (S / group + buffer K) + block_q block_k)``:

1. **Selection, in two passes over the keys.** Queries are taken a *chunk* at a time
   (``query_chunk``), scored ``block_q`` by ``block_k`` (``[B, block_q, block_k]``, never more).
   Pass 1 keeps each query's maximum over every ``group`` keys (as 16-bit order-preserving keys):
   if K groups reach a value, so do K scores, so the K-th largest group maximum bounds the
   query's K-th score from below (found by bisection over the maxima). Pass 2 buffers only the
   keys above the bound (about K of them once the query sees many more than ``K * group`` keys),
   located through one uint32 mask word per (at most) 32 keys, and the exact top-K is bisected
   within the buffer. Keys exactly *at* the bound (ReLU zeros tie by the thousand) are kept as a
   bitmask and taken lowest index first, as ``top_k`` breaks ties. A query whose candidates
   overflow the buffer (few keys seen, or a loose bound) refines the bound from its buffer's own
   K-th entry and collects again (how many candidates a round drops:
   :func:`~jaxmoe.attention.dsa_topk._raise_bound`). Key blocks past the last visible one are
   skipped.
2. **Attention, gathered.** Each query attends, in the absorbed (MQA-over-latent) form, to the
   ``C + R`` latent entries it selected, ``attn_block_q`` queries at a time, with an online
   softmax; the per-block work is rematerialised in the backward pass.

**Context parallelism** (mesh axis ``context`` of size P > 1, inside ``jax.shard_map``): each
shard keeps its queries; for every query chunk and pass, the indexer keys (with their positions)
travel round the ring with ``ppermute`` and every visiting shard's keys are scored; then the
latents travel round the ring and each query's online softmax absorbs the selected entries that
belong to the visiting shard (a shard none of a block's selections falls in is skipped). Key
indices are global (``shard * S_local + s``), so the selection equals the unsharded one. No
array anywhere has both a query and a key dimension longer than a block.

**The indexer's sparse-stage loss** (:func:`selection_terms`) runs the same selection, then two
walks of the latents round the ring give each selected entry's main-attention probability
(summed over heads; the first walk finds each head's softmax maximum and normaliser), and one
walk of the indexer keys gives the selected entries' index scores with their gradient: ``[B, T,
K]`` arrays, never ``[T, S]``.

Selection carries no gradient (as in the reference, whose indexer runs under ``no_grad``);
gradients reach queries and latents through the attention, and through ``ppermute``'s transpose
round the ring back to the shard that owns them.

Shape letters: B batch, T queries (local to a shard inside ``shard_map``), S keys, K selected
per query, N MLA heads, NI indexer heads, HI indexer head dim (N and H in
:mod:`~jaxmoe.attention.dsa_topk`), C latent dim, R rope dim (``C + R``: a latent with its rope
key riding along), P shards on ``context``. A chunk's queries come as ``nq`` blocks of ``bq`` in
the selection and ``na`` blocks of ``ba`` in the attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmoe.attention.context_parallel import CONTEXT, context_parallel_size, token_spec
from jaxmoe.attention.dsa_topk import Layout, select_chunk, varying

_NEVER = jnp.iinfo(jnp.int32).max  # position of padded keys: visible to no query


@dataclasses.dataclass(frozen=True)
class DSABlocks:
    """Block sizes of :func:`sparse_dsa` (static; results do not depend on them).

    Attributes:
        query_chunk: queries selected together; under context parallelism the keys go round the
            ring once per pass per chunk. Memory per chunk: ``query_chunk * slots / group`` int16
            group maxima and ``query_chunk * buffer * K`` candidate entries.
        block_q: queries scored together against a key block.
        block_k: keys per scored block.
        group: keys per group maximum (the bound of pass 1).
        attn_block_q: queries whose ``K`` selected latents are gathered together.
        append: entries per query a key block writes to the candidate buffer per round.
        buffer: candidates buffered per query, in multiples of K (at least 2).
        rounds: refinements at 16-bit resolution (one pass over the keys each) before exact ones.
    """

    query_chunk: int = 1024
    block_q: int = 64
    block_k: int = 2048
    group: int = 32
    attn_block_q: int = 64
    append: int = 32
    buffer: int = 4
    rounds: int = 16

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < (0 if f.name == "rounds" else 1):
                raise ValueError(f"DSABlocks.{f.name} must be a positive integer, got {v!r}")
        if self.buffer < 2:
            raise ValueError(f"DSABlocks.buffer must be at least 2 (K per refinement round), got {self.buffer}")


def streamed_topk(q_index, w_index, q_pos, k_index, k_pos, *, topk: int, blocks: DSABlocks = DSABlocks()):
    """The streamed selection on one device: ``(scores, indices, valid)``, each ``[B, T, K]``.

    Args as :func:`sparse_dsa`. Indices are unsorted; an entry is valid when its key is visible
    (its score finite). The same entries as ``top_k`` over the dense scores (ties: lower index).
    """
    B, T = q_pos.shape
    S = k_pos.shape[1]
    K = min(topk, S)
    chunk, bq, _, lay = _sizes(T, S, K, blocks, ring=1)
    T_pad = _round_up(T, chunk)

    def per_chunk(x):  # [B, T_pad, ...] -> [T_pad/chunk, chunk/bq, B, bq, ...]
        return jax.vmap(lambda c: _blocks(c, bq))(_blocks(x, chunk))

    q_in = (
        per_chunk(_pad(q_index, 1, T_pad, 0)),
        per_chunk(_pad(w_index.astype(jnp.float32), 1, T_pad, 0)),
        per_chunk(_pad(q_pos, 1, T_pad, -1)),
    )
    keys = (_blocks(_pad(k_index, 1, lay.S_pad, 0), lay.bk), _blocks(_pad(k_pos, 1, lay.S_pad, _NEVER), lay.bk))
    _, (vals, idx) = jax.lax.scan(lambda _, q: (None, select_chunk(*q, keys, 0, lay)), None, q_in)
    unblock = lambda x: jnp.moveaxis(x, 2, 0).reshape(B, T_pad, K)[:, :T]  # noqa: E731
    vals, idx = unblock(vals), unblock(idx)
    return vals, idx, jnp.isfinite(vals)


# --------------------------------------------------------------------------------------------
# Attention over the selected entries


def _attend_blocks(state, q_blocks, sel_blocks, latents, base, *, scale, latent_dim):
    """Online-softmax update of ``(m, l, acc)`` by the selected entries that lie in ``latents``.

    Args:
        state: ``m, l [na, B, ba, N]``, ``acc [na, B, ba, N, C]`` float32.
        q_blocks: ``[na, B, ba, N, C+R]`` absorbed queries with their rope part.
        sel_blocks: ``(idx [na, B, ba, K] global key indices, valid [na, B, ba, K])``.
        latents: ``[B, S, C+R]`` one shard's latents, global indices ``base .. base + S``.
    """
    S = latents.shape[1]

    def query_block(_, xs):
        q, idx, valid, m, l, acc = xs
        local = idx - base
        here = valid & (local >= 0) & (local < S)  # [B, ba, K]

        @jax.checkpoint  # the gathered [B, ba, K, C+R] is rebuilt in the backward pass
        def update(m, l, acc):
            sel = jax.vmap(lambda lat, i: lat[i])(latents, jnp.clip(local, 0, S - 1))  # [B, ba, K, C+R]
            logits = jnp.einsum("BTNC,BTKC->BTNK", q, sel, preferred_element_type=jnp.float32) * scale
            logits = jnp.where(here[:, :, None, :], logits, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(logits - m_safe[..., None])
            correction = jnp.exp(m - m_safe)
            l = l * correction + jnp.sum(p, axis=-1)
            values = sel[..., :latent_dim]
            pv = jnp.einsum("BTNK,BTKC->BTNC", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
            return m_new, l, acc * correction[..., None] + pv

        out = jax.lax.cond(jnp.any(here), update, lambda *c: c, m, l, acc)
        return None, out

    _, state = jax.lax.scan(query_block, None, (q_blocks, *sel_blocks, *state))
    return state


# --------------------------------------------------------------------------------------------
# One shard (or the whole sequence)


def _pad(x, axis, size, value):
    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x, size):
    """``[B, L, ...]`` (L a multiple of size) -> ``[L/size, B, size, ...]``."""
    B, L = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, L // size, size, *x.shape[2:]), 1, 0)


def _round_up(n, m):
    return -(-n // m) * m


def _sizes(T, S, K, blocks: DSABlocks, ring: int):
    """Block sizes fitted to the arrays (``bq | chunk``, ``ba | bq``, ``group | bk``) and the
    selection's :class:`~jaxmoe.attention.dsa_topk.Layout`."""
    bq = min(blocks.block_q, T)
    ba = min(blocks.attn_block_q, bq)
    bq = _round_up(bq, ba)
    # At most a quarter of the local queries per chunk: the chunk's working set (group maxima, tie
    # marks, candidate buffers) then shrinks with the local length, as the activations do, when
    # the context axis grows.
    chunk = _round_up(min(blocks.query_chunk, -(-T // 4)), bq)
    group = min(blocks.group, S)
    bk = _round_up(min(blocks.block_k, _round_up(S, group)), group)
    bits = max(d for d in range(1, 33) if bk % d == 0)  # keys per uint32 mask word
    S_pad = _round_up(S, bk)
    lay = Layout(
        K=K,
        bk=bk,
        bits=bits,
        group=group,
        slots=ring * S_pad,
        index_bound=ring * S,
        ring=ring,
        S=S,
        S_pad=S_pad,
        append=min(blocks.append, bk),
        buffer=max(min(blocks.buffer * K, ring * S), K),
        rounds=blocks.rounds,
    )
    return chunk, bq, ba, lay


def _dsa_shard(q_index, w_index, q_cat, q_pos, k_index, latents, k_pos, *, topk, scale, latent_dim, blocks, ring):
    """Sparse attention of one shard's queries to the selected keys of all shards.

    Args as :func:`sparse_dsa` (local arrays). ``ring`` is the ``context`` axis size (1: the
    whole sequence is local and nothing moves).

    Returns:
        ``o_latent[B, T, N, C]``, in ``latents``' dtype.
    """
    B, T, N, CR = q_cat.shape
    S = k_pos.shape[1]
    K = min(topk, S * ring)
    chunk, bq, ba, lay = _sizes(T, S, K, blocks, ring)
    T_pad = _round_up(T, chunk)
    na = chunk // ba
    shard = jax.lax.axis_index(CONTEXT) if ring > 1 else 0

    def per_chunk(x, size):  # [B, T_pad, ...] -> [T_pad/chunk, chunk/size, B, size, ...]
        x = _blocks(x, chunk)
        return jax.vmap(lambda c: _blocks(c, size))(x)

    q_in = (
        per_chunk(_pad(q_index, 1, T_pad, 0), bq),
        per_chunk(_pad(w_index.astype(jnp.float32), 1, T_pad, 0), bq),
        per_chunk(_pad(q_pos, 1, T_pad, -1), bq),  # padded queries see nothing
        per_chunk(_pad(q_cat, 1, T_pad, 0), ba),
    )
    keys = (_blocks(_pad(k_index, 1, lay.S_pad, 0), lay.bk), _blocks(_pad(k_pos, 1, lay.S_pad, _NEVER), lay.bk))
    perm = [(i, (i + 1) % ring) for i in range(ring)]

    def select(q_idx, w_idx, qp):
        return select_chunk(q_idx, w_idx, qp, keys, shard, lay)

    def attend(q, sel):
        f32 = jnp.float32
        m = varying(jnp.full((na, B, ba, N), -jnp.inf, f32), q)
        state = (
            m,
            varying(jnp.zeros((na, B, ba, N), f32), q),
            varying(jnp.zeros((na, B, ba, N, latent_dim), f32), q),
        )

        def visit(carry, step):
            state, lat = carry
            base = ((shard - step) % ring) * S
            state = _attend_blocks(state, q, sel, lat, base, scale=scale, latent_dim=latent_dim)
            if ring > 1:
                lat = jax.lax.ppermute(lat, CONTEXT, perm)
            return (state, lat), None

        ((m, l, acc), _), _ = jax.lax.scan(visit, (state, latents), jnp.arange(ring))
        return acc / jnp.where(l > 0, l, 1.0)[..., None]  # [na, B, ba, N, C]

    def one_chunk(_, xs):
        q_idx, w_idx, qp, q = xs
        with jax.named_scope("dsa_select"):
            vals, idx = jax.lax.stop_gradient(select(q_idx, w_idx, qp))  # [nq, B, bq, K]
            to_attn = lambda x: _blocks(jnp.moveaxis(x, 0, 1).reshape(B, chunk, K), ba)  # noqa: E731
            sel = (to_attn(idx), to_attn(jnp.isfinite(vals)))  # [na, B, ba, K]
        with jax.named_scope("dsa_attend"):
            out = attend(q, sel)
        return None, jnp.moveaxis(out, 0, 1).reshape(B, chunk, N, latent_dim)

    _, out = jax.lax.scan(one_chunk, None, q_in)  # [T_pad/chunk, B, chunk, N, C]
    out = jnp.moveaxis(out, 0, 1).reshape(B, T_pad, N, latent_dim)[:, :T]
    return out.astype(latents.dtype)


# --------------------------------------------------------------------------------------------
# The indexer's sparse-stage loss terms, over the selected entries only


def _gather(values, idx, base, S):
    """``values[B, S, ...]`` (global indices ``base .. base + S``) at ``idx[B, T, K]``:
    ``([B, T, K, ...], here[B, T, K])``, ``here`` where the index lies in this shard."""
    here = (idx >= base) & (idx < base + S)
    return jax.vmap(lambda v, i: v[i])(values, jnp.clip(idx - base, 0, S - 1)), here


def _in_shard(idx, valid, base, S):
    """Whether any valid index lies in the shard holding ``base .. base + S`` (else its visit is skipped)."""
    return jnp.any(valid & (idx >= base) & (idx < base + S))


def _ring_walk(fold, blocks, carry, values, shard, ring):
    """Folds every shard's ``values`` into per-query-block ``carry``: ``fold(xs, values, base)``
    gets one block's slice of ``blocks + carry`` and returns its new ``carry`` slice; ``values``
    (global indices from ``base``) go round the ring."""
    S = values.shape[1]
    perm = [(i, (i + 1) % ring) for i in range(ring)]

    def visit(c, step):
        carry, vals = c
        base = ((shard - step) % ring) * S
        _, carry = jax.lax.scan(lambda _, xs: (None, fold(xs, vals, base)), None, (*blocks, *carry))
        if ring > 1:
            vals = jax.lax.ppermute(vals, CONTEXT, perm)
        return (carry, vals), None

    (carry, _), _ = jax.lax.scan(visit, (tuple(carry), values), jnp.arange(ring))
    return carry


def _selected_probs(q_blocks, idx, valid, latents, shard, *, scale, ring):
    """The main attention's probabilities over each query's selected entries, summed over heads.

    Two walks round the ring: the first finds each head's softmax maximum and normaliser over the
    selection, the second adds up each visiting shard's entries. No gradient is taken through it.

    Args:
        q_blocks: ``[na, B, ba, N, C+R]``; idx, valid: ``[na, B, ba, K]`` (global key indices).
        latents: ``[B, S, C+R]`` this shard's latents.

    Returns:
        ``[na, B, ba, K]`` float32 ``sum_n p[n, k]``, zero where not valid.
    """
    S = latents.shape[1]

    def logits_at(q, i, v, lat, base):
        sel, here = _gather(lat, i, base, S)  # [B, ba, K, C+R]
        here &= v
        logits = jnp.einsum("BTNC,BTKC->BTNK", q, sel, preferred_element_type=jnp.float32) * scale
        return jnp.where(here[:, :, None, :], logits, -jnp.inf), here

    def stats(xs, lat, base):
        q, i, v, m, l = xs

        def update(m, l):
            logits, _ = logits_at(q, i, v, lat, base)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            l = l * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(logits - m_safe[..., None]), axis=-1)
            return m_new, l

        return jax.lax.cond(_in_shard(i, v, base, S), update, lambda *c: c, m, l)

    def probs(xs, lat, base):
        q, i, v, m, l, p = xs

        def add(p):
            logits, here = logits_at(q, i, v, lat, base)
            p_heads = (
                jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]) / jnp.where(l > 0, l, 1.0)[..., None]
            )
            return jnp.where(here, jnp.sum(p_heads, axis=2), p)

        return (jax.lax.cond(_in_shard(i, v, base, S), add, lambda p: p, p),)

    na, B, ba, N = q_blocks.shape[:4]
    zeros = varying(jnp.zeros((na, B, ba, N), jnp.float32), q_blocks)
    m, l = _ring_walk(stats, (q_blocks, idx, valid), (jnp.full_like(zeros, -jnp.inf), zeros), latents, shard, ring)
    p = varying(jnp.zeros(idx.shape, jnp.float32), q_blocks)
    (p,) = _ring_walk(probs, (q_blocks, idx, valid, m, l), (p,), latents, shard, ring)
    return p


def _selected_scores(q_idx, w_idx, idx, valid, k_index, shard, *, ring):
    """The index scores of each query's selected keys, differentiable in the indexer's queries,
    weights and keys (the keys' gradient goes back round the ring to the shard that owns them).

    Args:
        q_idx: ``[nq, B, bq, NI, HI]``; w_idx: ``[nq, B, bq, NI]``; idx, valid: ``[nq, B, bq, K]``.
        k_index: ``[B, S, HI]`` this shard's indexer keys.

    Returns:
        ``[nq, B, bq, K]`` float32 (zero where not valid).
    """
    S = k_index.shape[1]

    def scores(xs, keys, base):
        q, w, i, v, s = xs

        @jax.checkpoint  # the gathered [B, bq, K, HI] keys are rebuilt in the backward pass
        def at(q, w, keys):
            sel, here = _gather(keys, i, base, S)
            dots = jnp.einsum("BTNH,BTKH->BTNK", q, sel, preferred_element_type=jnp.float32)
            return jnp.where(here & v, jnp.einsum("BTN,BTNK->BTK", w, jax.nn.relu(dots)), s)

        return (jax.lax.cond(_in_shard(i, v, base, S), at, lambda *_: s, q, w, keys),)

    s = varying(jnp.zeros(idx.shape, jnp.float32), q_idx)
    (s,) = _ring_walk(scores, (q_idx, w_idx, idx, valid), (s,), k_index, shard, ring)
    return s


def _selection_terms_shard(q_index, w_index, q_cat, q_pos, k_index, latents, k_pos, *, topk, scale, blocks, ring):
    """:func:`selection_terms` on one shard's queries (local arrays; ``ring`` as in :func:`_dsa_shard`)."""
    B, T, N, _ = q_cat.shape
    S = k_pos.shape[1]
    K = min(topk, S * ring)
    chunk, bq, ba, lay = _sizes(T, S, K, blocks, ring)
    T_pad = _round_up(T, chunk)
    shard = jax.lax.axis_index(CONTEXT) if ring > 1 else 0

    def per_chunk(x, size):  # [B, T_pad, ...] -> [T_pad/chunk, chunk/size, B, size, ...]
        return jax.vmap(lambda c: _blocks(c, size))(_blocks(x, chunk))

    q_in = (
        per_chunk(_pad(q_index, 1, T_pad, 0), bq),
        per_chunk(_pad(w_index.astype(jnp.float32), 1, T_pad, 0), bq),
        per_chunk(_pad(q_pos, 1, T_pad, -1), bq),
        per_chunk(_pad(jax.lax.stop_gradient(q_cat), 1, T_pad, 0), ba),
    )
    keys = (_blocks(_pad(k_index, 1, lay.S_pad, 0), lay.bk), _blocks(_pad(k_pos, 1, lay.S_pad, _NEVER), lay.bk))
    latents = jax.lax.stop_gradient(latents)

    def one_chunk(_, xs):
        q_idx, w_idx, qp, q = xs
        with jax.named_scope("dsa_select"):
            detached = jax.lax.stop_gradient((q_idx, w_idx, keys))
            vals, idx = select_chunk(detached[0], detached[1], qp, detached[2], shard, lay)  # [nq, B, bq, K]
            valid = jnp.isfinite(vals)
        per_query = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, chunk, K)  # noqa: E731  [n, B, b, K] -> [B, chunk, K]
        to_attn = lambda x: _blocks(per_query(x), ba)  # noqa: E731
        with jax.named_scope("dsa_target"):
            target = _selected_probs(q, to_attn(idx), to_attn(valid), latents, shard, scale=scale, ring=ring)
        with jax.named_scope("dsa_selected_scores"):
            scores = _selected_scores(q_idx, w_idx, idx, valid, k_index, shard, ring=ring)
        return None, (per_query(target), per_query(scores), per_query(valid))

    _, out = jax.lax.scan(one_chunk, None, q_in)  # each [T_pad/chunk, B, chunk, K]
    return tuple(jnp.moveaxis(x, 0, 1).reshape(B, T_pad, K)[:, :T] for x in out)


# --------------------------------------------------------------------------------------------
# Entry point


def sparse_dsa(
    q_index: jax.Array,
    w_index: jax.Array,
    q_cat: jax.Array,
    q_pos: jax.Array,
    k_index: jax.Array,
    latents: jax.Array,
    k_pos: jax.Array,
    *,
    topk: int,
    scale: float,
    latent_dim: int,
    blocks: DSABlocks = DSABlocks(),
) -> jax.Array:
    """Each query attends to the ``topk`` keys its indexer scores highest, without ``[T, S]`` arrays.

    Runs context-parallel (inside ``jax.shard_map``, the sequence split over ``context``) when a
    mesh whose ``context`` axis is larger than 1 is set; otherwise on the whole sequence.

    Args:
        q_index: ``[B, T, NI, HI]`` rotated indexer queries.
        w_index: ``[B, T, NI]`` indexer head weights, scales folded in (see
            :func:`jaxmoe.attention.dsa_topk.index_scores`).
        q_cat: ``[B, T, N, C+R]`` absorbed MLA queries ``[q_nope kv_b_k, q_rope]``.
        q_pos: ``[B, T]`` int32 query positions.
        k_index: ``[B, S, HI]`` rotated indexer keys.
        latents: ``[B, S, C+R]`` normalised ``c_kv`` and rotated ``k_rope`` per key.
        k_pos: ``[B, S]`` int32 key positions; key s is a candidate for query t when
            ``k_pos[s] <= q_pos[t]``.
        topk: keys kept per query (``min(topk, S)``); scale: softmax scale; latent_dim: C.
        blocks: block sizes.

    Returns:
        ``o_latent[B, T, N, C]``: attention output in latent space (``latents``' dtype); a
        query that sees no key gets zeros. Gradients flow to ``q_cat`` and ``latents`` only.
    """
    idx_in = jax.lax.stop_gradient((q_index, w_index, k_index))
    args = (idx_in[0], idx_in[1], q_cat, q_pos, idx_in[2], latents, k_pos)
    kw = dict(topk=topk, scale=scale, latent_dim=latent_dim, blocks=blocks)
    return _on_context_shards(_dsa_shard, args, kw, out_ndims=4)


def selection_terms(
    q_index: jax.Array,
    w_index: jax.Array,
    q_cat: jax.Array,
    q_pos: jax.Array,
    k_index: jax.Array,
    latents: jax.Array,
    k_pos: jax.Array,
    *,
    topk: int,
    scale: float,
    blocks: DSABlocks = DSABlocks(),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the indexer's sparse-stage KL loss needs, per query and selected key, without ``[T, S]`` arrays.

    The selection is :func:`sparse_dsa`'s (the same streamed top-K, context-parallel likewise).
    Args as :func:`sparse_dsa` (``latent_dim`` is not needed).

    Returns:
        ``(probs, scores, valid)``, each ``[B, T, K]`` over one query's K selected keys (in no
        particular order): ``probs`` the main attention's probabilities summed over heads (no
        gradient), ``scores`` the index scores (differentiable in ``q_index``, ``w_index`` and
        ``k_index``), ``valid`` where a key was selected (a query with fewer than K visible keys
        has invalid entries; both arrays are zero there).
    """
    args = (q_index, w_index, q_cat, q_pos, k_index, latents, k_pos)
    kw = dict(topk=topk, scale=scale, blocks=blocks)
    return _on_context_shards(_selection_terms_shard, args, kw, out_ndims=(3, 3, 3))


def _on_context_shards(fn, args, kw, *, out_ndims):
    """``fn(*args, ring=P, **kw)`` on the whole sequence (P = 1), or, when the mesh's ``context``
    axis is P > 1, inside ``jax.shard_map`` on each shard's tokens. ``args`` as :func:`sparse_dsa`'s
    positional arguments; ``out_ndims``: the rank of each output (batch and tokens leading)."""
    ring = context_parallel_size()
    if ring == 1:
        return fn(*args, ring=1, **kw)
    for name, a in (("q_cat", args[2]), ("latents", args[5])):
        if a.shape[1] % ring:
            raise ValueError(
                f"DSA context parallelism: {name} has sequence length {a.shape[1]}, which must be a multiple "
                f"of the mesh's 'context' axis size {ring}"
            )
    batch = args[2].shape[0]
    in_specs = tuple(token_spec(batch, a.ndim) for a in args)
    out_specs = jax.tree.map(lambda n: token_spec(batch, n), out_ndims)
    return jax.shard_map(functools.partial(fn, ring=ring, **kw), in_specs=in_specs, out_specs=out_specs)(*args)
