"""The streamed top-K of DeepSeek sparse attention's selection, a query chunk at a time.

:func:`jaxmoe.attention.dsa_context.sparse_dsa` selects each query's K keys without a ``[T, S]``
array in two passes over the keys (see its module docstring): per-query group maxima give a lower
bound on the K-th score, then only keys above the bound are buffered and the exact top-K (ties:
lower index first, as ``top_k``) is bisected within the buffer. Here: the index scores, the
order-preserving int keys, the buffer primitives and :func:`select_chunk`, which runs both passes
for one chunk of queries, with the keys going round the ``context`` ring under context
parallelism.

Shape letters: B batch, T queries, S keys, N indexer heads, H indexer head dim, K keys selected
per query, C candidates buffered per query (``Layout.buffer``; not a latent dim here), G group
maxima per query (``slots / group``), W uint32 tie-mark words per query (``slots / bits``), M
entries written per append round. A chunk's queries come as ``nq`` blocks of ``bq``, a shard's
keys as ``nb`` blocks of ``bk`` (``nw = bk / bits`` mask words each).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmoe.attention.context_parallel import CONTEXT

# --------------------------------------------------------------------------------------------
# Mesh helpers


def varying(x, like):
    """``x`` marked as varying over the mesh axes ``like`` varies over (scan carries must agree)."""
    missing = tuple(sorted(jax.typeof(like).manual_axis_type.varying - jax.typeof(x).manual_axis_type.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# --------------------------------------------------------------------------------------------
# Index scores (shared with the dense reference in dsa.py)


def index_scores(q: jax.Array, w: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """``I[t, s] = sum_n w[t, n] relu(q[t, n] . k[s])``, ``-inf`` where ``k_pos[s] > q_pos[t]``.

    Args:
        q: ``[B, T, N, H]`` rotated indexer queries; w: ``[B, T, N]`` float32 head weights with
            both of the indexer's scales folded in; k: ``[B, S, H]`` rotated indexer keys.
        q_pos: ``[B, T]``; k_pos: ``[B, S]`` int32 positions.

    Returns:
        ``[B, T, S]`` float32. Heads are summed one 2-D matmul at a time (the indexer has few
        heads), which XLA:CPU runs faster than a ``[B, T, N, S]`` einsum.
    """
    scores = jnp.zeros((), jnp.float32)
    for n in range(q.shape[2]):
        dots = jnp.einsum("BTH,BSH->BTS", q[:, :, n], k, preferred_element_type=jnp.float32)
        scores = scores + w[:, :, n, None] * jax.nn.relu(dots)
    visible = k_pos[:, None, :] <= q_pos[:, :, None]
    return jnp.where(visible, scores, -jnp.inf)


# --------------------------------------------------------------------------------------------
# Streamed top-K: a group-maximum bound, then the few keys above it


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (``-inf`` lowest, ``-0.0`` equal to ``0.0``; no NaNs here)."""
    b = jnp.where(x == 0, 0, jax.lax.bitcast_convert_type(x, jnp.int32))
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _unsortable(key: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


_NEG_INF_KEY = -2139095041  # _sortable(-inf)
_KEY16_NEG_INF = _NEG_INF_KEY >> 16  # its top 16 bits


def _bisect(ok, lo, hi, iters: int, like):
    """Largest ``v`` in ``[lo, hi)`` with ``ok(v)``, elementwise; ``ok`` is monotone (true below,
    false above), ``ok(lo)`` holds and ``ok(hi)`` does not. ``iters >= log2(hi - lo)``. ``like``:
    an array ``ok`` reads (the bounds vary over the same mesh axes)."""
    lo, hi = varying(lo, like), varying(hi, like)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    return jax.lax.fori_loop(0, iters, step, (lo, hi))[0]


def _count(mask: jax.Array) -> jax.Array:
    """``sum(mask, -1)`` as int32, through a matrix-vector product (XLA:CPU vectorises it; its
    minor-axis reductions it does not). Exact below 2**24."""
    ones = jnp.ones(mask.shape[-1], jnp.float32)
    return jnp.einsum("...c,c->...", mask.astype(jnp.float32), ones, precision="highest").astype(jnp.int32)


def _group_bound(gm16: jax.Array, K: int) -> jax.Array:
    """A lower bound on each query's K-th largest score from its group maxima.

    ``gm16[..., G]`` holds the top 16 bits of :func:`_sortable` of every group's maximum. If at
    least K groups reach ``v``, so do at least K scores (one per group): the largest such ``v``
    bounds the K-th score from below, within the 16-bit resolution, and all scores above the
    bound lie in those groups. Fewer than K visible groups: ``-inf`` (every visible key).
    """
    lo = jnp.full(gm16.shape[:-1], _KEY16_NEG_INF, jnp.int32)
    hi = jnp.full(gm16.shape[:-1], 32768, jnp.int32)
    v = _bisect(lambda v: _count(gm16 >= v[..., None].astype(gm16.dtype)) >= K, lo, hi, 17, gm16)
    bound = _unsortable(jnp.maximum(v, _KEY16_NEG_INF + 1) << 16)
    return jnp.where(v > _KEY16_NEG_INF, bound, -jnp.inf)


def _select_bit(word: jax.Array, r: jax.Array, bits: int) -> jax.Array:
    """Position of the ``r``-th (0-based) set bit of each uint32 ``word`` (``r`` < its popcount)."""
    pos = jnp.zeros(word.shape, jnp.int32)
    step = 1 << (bits - 1).bit_length() - 1 if bits > 1 else 0
    while step:
        cand = pos + step
        below = jax.lax.population_count(word & ((jnp.uint32(1) << cand.astype(jnp.uint32)) - 1))
        pos = jnp.where((cand < bits) & (below.astype(jnp.int32) <= r), cand, pos)
        step >>= 1
    return pos


def _append(buf, s, take, idx_base, *, M: int, bits: int):
    """Appends the entries of ``s[B, T, S]`` where ``take`` holds to ``buf`` (in mask-word order, not key order).

    ``buf = (vals, idx [B, T, C], count [B, T])``; entries past ``C`` are dropped but counted.
    The entries are located through one uint32 mask word per ``bits`` keys (population counts,
    their running sum, a search for the j-th entry's word, then its bit) and written ``M`` per
    query at a time, as many rounds as the fullest query needs (usually none or one).
    """
    vals, idx, count = buf
    B, T, S = s.shape
    C = vals.shape[-1]
    nw = S // bits
    # Word j's bit t is key t * nw + j (strided, so the sum runs over a major axis and vectorises);
    # entries are appended in (word, bit) order, not key order: nothing downstream needs the order.
    shifts = jnp.arange(bits, dtype=jnp.uint32)[:, None]
    words = jnp.sum(take.reshape(B, T, bits, nw).astype(jnp.uint32) << shifts, axis=-2)
    pc = jax.lax.population_count(words).astype(jnp.int32)  # [B, T, nw]
    # Running sum as a product with a triangular matrix (XLA:CPU's cumsum is a reduce-window).
    upper = jnp.triu(jnp.ones((nw, nw), jnp.float32))
    csum = jnp.einsum("BTw,wv->BTv", pc.astype(jnp.float32), upper, precision="highest").astype(jnp.int32)
    n = csum[..., -1]  # [B, T]
    put = jax.vmap(jax.vmap(lambda buf, slot, x: buf.at[slot].set(x, mode="drop")))

    def write(r, vals_idx):
        vals, idx = vals_idx
        j = r * M + jnp.arange(M, dtype=jnp.int32)
        w = _count(csum[..., None, :] <= j[:, None])  # [B, T, M]: the word holding the j-th entry
        w = jnp.minimum(w, nw - 1)
        rank = j - (jnp.take_along_axis(csum, w, axis=-1) - jnp.take_along_axis(pc, w, axis=-1))
        e = _select_bit(jnp.take_along_axis(words, w, axis=-1), rank, bits) * nw + w  # [B, T, M] key offsets
        slot = jnp.where(j < n[..., None], count[..., None] + j, C)  # C: dropped
        return put(vals, slot, jnp.take_along_axis(s, e, axis=-1)), put(idx, slot, idx_base + e)

    rounds = (jnp.max(jnp.clip(jnp.minimum(n, C - count), 0)) + M - 1) // M  # nothing to write once full
    vals, idx = jax.lax.fori_loop(0, rounds, write, (vals, idx))
    return vals, idx, count + n


def _kth(buf, K: int, index_bound: int):
    """The K-th largest buffered entry per query, in the order (score desc, index asc).

    ``buf = (vals, idx [..., C], count [...])``; the first ``min(count, C)`` entries are valid.
    Returns ``(top, last)``: its :func:`_sortable` key and the largest index taken among entries
    with that key, so ``key > top or (key == top and idx <= last)`` holds for exactly
    ``min(K, valid)`` of them. Fewer than K entries: the smallest, so all are taken.
    """
    vals, idx, count = buf
    C = vals.shape[-1]
    valid = jnp.arange(C) < count[..., None]
    keys = jnp.where(valid, _sortable(vals), jnp.iinfo(jnp.int32).min)
    lead = keys.shape[:-1]
    need = jnp.minimum(jnp.minimum(count, C), K)
    top = _bisect(
        lambda v: _count(keys >= v[..., None]) >= need,
        jnp.full(lead, jnp.iinfo(jnp.int32).min, jnp.int32),
        jnp.max(keys, axis=-1) + 1,
        32,
        keys,
    )
    m = need - _count(keys > top[..., None])  # ties to take, lowest indices first
    tied = valid & (keys == top[..., None])

    def last_tied():
        return _bisect(
            lambda v: _count(tied & (idx < v[..., None])) < m,
            jnp.full(lead, -1, jnp.int32),
            jnp.full(lead, index_bound, jnp.int32),
            max(index_bound + 1, 2).bit_length() + 1,
            keys,
        )

    # Only when some query has more entries at the K-th score than it takes is the index needed.
    everything = varying(jnp.full(lead, index_bound, jnp.int32), keys)
    last = jax.lax.cond(jnp.any(_count(tied) > m), last_tied, lambda: everything)
    return top, last


def _choose(buf, K: int, index_bound: int):
    """The K largest of each query's buffered entries (ties: lower index first), ``[..., K]``.

    ``buf = (vals, idx [..., C], count [...])`` with ``count <= C``; fewer than K entries: all of
    them, the rest ``-inf``.
    """
    vals, idx, count = buf
    C = vals.shape[-1]
    top, last = _kth(buf, K, index_bound)
    keys = _sortable(vals)
    take = (jnp.arange(C) < count[..., None]) & (
        (keys > top[..., None]) | ((keys == top[..., None]) & (idx <= last[..., None]))
    )
    slot = jnp.where(take, jnp.cumsum(take, axis=-1) - 1, K)
    lead = vals.shape[:-1]
    put = lambda init, x: jax.vmap(lambda s, v: init.at[s].set(v, mode="drop"))(  # noqa: E731
        slot.reshape(-1, C), x.reshape(-1, C)
    ).reshape(*lead, K)
    return put(jnp.full((K,), -jnp.inf, jnp.float32), vals), put(jnp.zeros((K,), jnp.int32), idx)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static sizes of one selection: K kept, bk keys per block (``bits`` per mask word), ``group``
    keys per group maximum, ``slots`` key slots over all shards (padded), ``index_bound`` > every
    global index, ``ring`` shards, ``S``/``S_pad`` keys per shard, ``append`` entries written per
    round, ``buffer`` candidates per query, ``rounds`` 16-bit refinements before exact ones."""

    K: int
    bk: int
    bits: int
    group: int
    slots: int
    index_bound: int
    ring: int
    S: int
    S_pad: int
    append: int
    buffer: int
    rounds: int


# --------------------------------------------------------------------------------------------
# One chunk's selection: select_chunk, then its steps in the order it takes them


def select_chunk(q_idx, w_idx, qp, keys, shard, lay: Layout):
    """The top-K keys of every query of one chunk: ``(vals, idx)``, each ``[nq, B, bq, K]``.

    Args:
        q_idx, w_idx, qp: the chunk's query blocks ``[nq, B, bq, ...]``.
        keys: this shard's ``(k [nb, B, bk, H], pos [nb, B, bk])``; under context parallelism they
            go round the ring (``ppermute``) once per pass.
        shard: this shard's index on ``context`` (0 without context parallelism).
        lay: the selection's static sizes.

    The steps, in order: pass 1 (:func:`_group_bounds`) bounds each query's K-th score from below
    by its group maxima; pass 2 (:func:`_candidates`) buffers the keys above the bound (typically
    about K of them) and marks those at it, raising the bound and collecting again while some
    query's candidates overflow its buffer; :func:`_choose` takes the exact top-K within each
    buffer, and :func:`_add_ties` completes a query with fewer than K above the bound from its
    lowest-index keys at the bound.
    """
    queries = (q_idx, w_idx, qp)
    bound = _group_bounds(queries, keys, shard, lay)  # [nq, B, bq] float32
    (buf, marks), top = _candidates(bound, queries, keys, shard, lay)
    chosen = jax.lax.map(lambda b: _choose(b, lay.K, lay.index_bound), buf)  # a query block at a time
    n = jnp.minimum(buf[2], lay.K)  # entries above the bound (all chosen when fewer than K)

    def fill():
        return jax.lax.map(functools.partial(_add_ties, lay=lay), (chosen, n, marks, _unsortable(top)))

    return jax.lax.cond(jnp.any(n < lay.K), fill, lambda: chosen)


def _ring_pass(carry, fn, queries, keys, shard, lay: Layout):
    """One pass of a chunk's queries over every key they can see: ``fn`` folded into ``carry``.

    Args:
        carry: a pytree of per-query-block arrays ``[nq, ...]``.
        fn: ``fn(part, i, s, slot_base, index_base) -> part``, called with query block ``i``'s
            slice of ``carry`` and its scores ``s [B, bq, bk]`` against one key block, whose first
            key has slot ``slot_base`` (of ``slots``, padded) and global index ``index_base``.
        queries, keys, shard: as :func:`select_chunk`. Under context parallelism the keys go round
            the ring: at step ``r`` a shard scores shard ``shard - r``'s keys.
    """
    nq = queries[2].shape[0]
    perm = [(i, (i + 1) % lay.ring) for i in range(lay.ring)]

    def visit(c, step):
        carry, ks = c
        src = (shard - step) % lay.ring
        first_pos = jnp.min(ks[1], axis=(1, 2))  # [nb]
        block = functools.partial(
            _score_query_block, fn=fn, queries=queries, ks=ks, first_pos=first_pos, src=src, lay=lay
        )
        carry = jax.lax.fori_loop(0, nq, block, carry)
        if lay.ring > 1:
            ks = jax.lax.ppermute(ks, CONTEXT, perm)
        return (carry, ks), None

    (carry, _), _ = jax.lax.scan(visit, (carry, keys), jnp.arange(lay.ring))
    return carry


def _score_query_block(i, carry, *, fn, queries, ks, first_pos, src, lay: Layout):
    """:func:`_ring_pass`'s step for query block ``i`` and the key blocks ``ks`` of shard ``src``
    (``first_pos [nb]``: each block's smallest position), scored ``[B, bq, bk]`` one at a time."""
    part = jax.tree.map(lambda x: x[i], carry)
    q, w, p = (x[i] for x in queries)
    # Blocks past the last one holding a visible key are skipped (positions need not be sorted:
    # earlier invisible blocks are computed, masked).
    ahead = jnp.max(jnp.where(first_pos <= jnp.max(p), jnp.arange(first_pos.shape[0]) + 1, 0))
    k_all, kp_all = ks

    def key_block(b, part):
        s = index_scores(q, w, k_all[b], p, kp_all[b])  # [B, bq, bk]
        start = b * lay.bk
        return fn(part, i, s, src * lay.S_pad + start, src * lay.S + start)

    part = jax.lax.fori_loop(0, ahead, key_block, part)
    return jax.tree.map(lambda x, y: x.at[i].set(y), carry, part)


def _uniform(x, ring: int):
    """A value every device agrees on: XLA:CPU's collectives rendezvous with every device of the
    program, so a branch holding a ``ppermute`` must be taken everywhere or nowhere."""
    return jax.lax.pmax(x, jax.sharding.get_abstract_mesh().axis_names) if ring > 1 else x


# --------------------------------------------------------------------------------------------
# Pass 1: group maxima, then the bound


def _group_bounds(queries, keys, shard, lay: Layout):
    """Each query's lower bound on its K-th score, ``[nq, B, bq]`` float32.

    One pass stores every query's ``G = slots / group`` group maxima (``[nq, B, bq, G]`` int16,
    :func:`_group_max`), then :func:`_group_bound` bisects them. Fewer groups than K in all:
    ``-inf`` (no bound).
    """
    nq, B, bq = queries[2].shape
    G = lay.slots // lay.group
    if G < lay.K:
        return varying(jnp.full((nq, B, bq), -jnp.inf, jnp.float32), queries[0])
    gm = varying(jnp.full((nq, B, bq, G), _KEY16_NEG_INF, jnp.int16), queries[0])
    gm = _ring_pass(gm, functools.partial(_group_max, lay=lay), queries, keys, shard, lay)
    return jax.lax.map(lambda g: _group_bound(g, lay.K), gm)  # one query block at a time


def _group_max(gm, i, s, slot_base, index_base, *, lay: Layout):
    """Writes the maxima of the ``bk / group`` groups of one key block, ``s [B, bq, bk]``, into
    ``gm [B, bq, G]`` (the top 16 bits of their :func:`_sortable` keys) from group ``slot_base /
    group`` on."""
    B, bq, bk = s.shape
    m = jnp.max(s.reshape(B, bq, lay.group, bk // lay.group), axis=-2)  # group j: keys j, j + bk/group, ...
    return jax.lax.dynamic_update_slice(gm, (_sortable(m) >> 16).astype(jnp.int16), (0, 0, slot_base // lay.group))


# --------------------------------------------------------------------------------------------
# Pass 2: the candidates above the bound, refined until they fit


def _candidates(bound, queries, keys, shard, lay: Layout):
    """Every query's candidates, the keys scoring above its bound, and its ties, the keys at it.

    Entries above the bound are buffered, entries exactly at it (ReLU zeros tie by the thousand)
    only marked: a query with fewer than K above takes its lowest-index ties (:func:`_add_ties`).
    While some query has more candidates than its buffer holds, :func:`_raise_bound` raises its
    bound and all queries collect again.

    Args:
        bound: ``[nq, B, bq]`` float32, from :func:`_group_bounds`.

    Returns:
        ``(buf, marks)`` as :func:`_collect` returns them, every ``count <= C``, and ``top [nq, B,
        bq]``, the final bounds as :func:`_sortable` keys.
    """
    top = _sortable(bound)
    state = (_empty_candidates(queries[0], lay), top, jnp.zeros((), jnp.int32))

    def overflows(state):  # round 0 always collects; then: does a query on any shard overflow?
        (buf, _), _, r = state
        return (r == 0) | (_uniform(jnp.max(buf[2]), lay.ring) > lay.buffer)

    def refine(state):  # one collection per round (one traced copy of the pass: compile time)
        (buf, _), top, r = state
        over = buf[2] > lay.buffer  # never in round 0 (empty buffer)
        top = jnp.where(over, jax.lax.map(lambda xs: _raise_bound(xs, r > lay.rounds, lay), (*buf, top)), top)
        return _collect(top, queries, keys, shard, lay), top, r + 1

    (buf, marks), top, _ = jax.lax.while_loop(overflows, refine, state)
    return (buf, marks), top


def _empty_candidates(like, lay: Layout):
    """Empty ``(buf, marks)`` (as :func:`_collect` returns them) for the chunk of ``like [nq, B, bq, ...]``,
    varying over the mesh axes ``like`` varies over."""
    nq, B, bq = like.shape[:3]
    buf = (
        jnp.full((nq, B, bq, lay.buffer), -jnp.inf, jnp.float32),
        jnp.zeros((nq, B, bq, lay.buffer), jnp.int32),
        jnp.zeros((nq, B, bq), jnp.int32),
    )
    marks = jnp.zeros((nq, B, bq, lay.slots // lay.bits), jnp.uint32)
    return jax.tree.map(lambda x: varying(x, like), (buf, marks))


def _collect(top, queries, keys, shard, lay: Layout):
    """One pass buffering each query's visible keys with :func:`_sortable` key ``> top [nq, B, bq]``.

    Returns:
        ``(buf, marks)``: ``buf = (vals, idx [nq, B, bq, C], count [nq, B, bq])`` as
        :func:`_append` fills it (past ``C`` dropped but counted); ``marks [nq, B, bq, W]`` uint32,
        a bitmask over all key slots (bit order = slot order) of the visible keys with key
        ``== top``, for :func:`_add_ties`.
    """
    add = functools.partial(_add_candidates, top=top, lay=lay)
    return _ring_pass(_empty_candidates(queries[0], lay), add, queries, keys, shard, lay)


def _add_candidates(carry, i, s, slot_base, index_base, *, top, lay: Layout):
    """:func:`_collect`'s step for query block ``i`` and one key block's scores ``s [B, bq, bk]``:
    ``carry = ((vals, idx [B, bq, C], count [B, bq]), marks [B, bq, W])``."""
    buf, marks = carry
    B, bq, _ = s.shape
    take = (s > -jnp.inf) & (_sortable(s) > top[i][..., None])
    buf = _append(buf, s, take, index_base, M=lay.append, bits=lay.bits)
    at = (s > -jnp.inf) & (_sortable(s) == top[i][..., None])
    nw = lay.bk // lay.bits
    words = jnp.sum(
        at.reshape(B, bq, nw, lay.bits).astype(jnp.uint32) << jnp.arange(lay.bits, dtype=jnp.uint32),
        axis=-1,
    )  # [B, bq, nw]
    marks = jax.lax.dynamic_update_slice(marks, words, (0, 0, slot_base // lay.bits))
    return buf, marks


def _raise_bound(xs, exact_only, lay: Layout):
    """A higher bound for one query block whose candidates overflow, ``[B, bq]`` :func:`_sortable` keys.

    ``xs = (vals, idx [B, bq, C], count [B, bq], top [B, bq])``. The buffered entries are a subset
    of the query's keys, all above ``top``, so at least K keys reach their K-th: the new bound is
    that K-th at 16-bit resolution (cheap), exact where the coarse one is no higher than ``top``
    and everywhere once ``exact_only`` (after ``rounds`` rounds). Fewer than K buffered entries lie
    above the exact K-th, so an exact round drops at least ``C - K + 1`` of the query's candidates
    (``C = buffer * K`` in :class:`~jaxmoe.attention.dsa_context.DSABlocks` terms: at least
    ``(buffer - 1) K + 1``), and the refinement ends; a 16-bit round only raises the bound.
    """
    vals, idx, n, top = xs
    C, K = lay.buffer, lay.K
    held = jnp.arange(C) < jnp.minimum(n, C)[..., None]
    keys16 = jnp.where(held, _sortable(vals) >> 16, _KEY16_NEG_INF).astype(jnp.int16)
    coarse = _sortable(_group_bound(keys16, K))
    stuck = (n > C) & ((coarse <= top) | exact_only)
    exact = lambda: _kth((vals, idx, n), K, lay.index_bound)[0]  # noqa: E731
    return jnp.where(stuck, jax.lax.cond(jnp.any(stuck), exact, lambda: coarse), coarse)


# --------------------------------------------------------------------------------------------
# The ties


def _add_ties(xs, *, lay: Layout):
    """Fills the slots after each query's ``n`` chosen entries with its lowest-index marked keys.

    ``xs = ((vals, idx [B, bq, K]) chosen, n [B, bq], marks [B, bq, W], value [B, bq])`` for one
    query block, ``value`` the score of the marked keys (the bound). Returns ``(vals, idx)``.
    """
    (vals, idx), n, marks, value = xs
    K = lay.K
    pc = jax.lax.population_count(marks).astype(jnp.int32)  # [B, bq, W]
    csum = jnp.cumsum(pc, axis=-1)
    j = jnp.arange(K, dtype=jnp.int32)
    w = jax.vmap(jax.vmap(lambda c: jnp.searchsorted(c, j, side="right")))(csum)  # [B, bq, K]: the j-th tie's word
    w = jnp.minimum(w, marks.shape[-1] - 1).astype(jnp.int32)
    rank = j - (jnp.take_along_axis(csum, w, axis=-1) - jnp.take_along_axis(pc, w, axis=-1))
    slot = w * lay.bits + _select_bit(jnp.take_along_axis(marks, w, axis=-1), rank, lay.bits)
    index = (slot // lay.S_pad) * lay.S + slot % lay.S_pad
    dest = jnp.where(j < csum[..., -1:], n[..., None] + j, K)  # K: dropped (and past K)
    put = jax.vmap(jax.vmap(lambda a, d, x: a.at[d].set(x, mode="drop")))
    vals = put(vals, dest, jnp.broadcast_to(value[..., None], dest.shape))
    return vals, put(idx, dest, index)
