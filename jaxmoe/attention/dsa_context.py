"""DeepSeek sparse attention without ``[T, S]`` arrays: blockwise and context-parallel.

The dense DSA path (:meth:`jaxmoe.attention.dsa.DSA.select` then ``sparse_attention``) scores
every query against every key, ``[B, T, S]``, and gathers ``[B, T, K, C]``; both grow past any
memory long before a 1M-token context. :func:`sparse_dsa` computes the same result with memory
``O(T K / chunks + block_q block_k)``:

1. **Selection, streamed.** Queries are taken a *chunk* at a time (``query_chunk``); for the
   chunk, every key block is scored (``[B, block_q, block_k]``) and merged into a running
   top-K (values and global key indices, ``[B, query_chunk, K]``, unsorted). A merge only moves
   the block entries that beat the query's current K-th value: their count ``c`` (the largest
   over the block's queries) picks a static bucket ``M >= c``; the block's top-M candidates are
   found through group maxima (``top_k`` over ``block_k / group`` maxima, then over the M
   chosen groups), merged with the running set's M smallest, and the best M written back in
   their slots. Scores of later key blocks beat the threshold rarely, so most merges are small.
   Key blocks no query of the block can see are skipped.
2. **Attention, gathered.** Each query attends, in the absorbed (MQA-over-latent) form, to the
   ``C + R`` latent entries it selected, ``attn_block_q`` queries at a time, with an online
   softmax; the per-block work is rematerialised in the backward pass.

**Context parallelism** (mesh axis ``context`` of size P > 1, inside ``jax.shard_map``): each
shard keeps its queries; for every query chunk, the indexer keys (with their positions) travel
round the ring with ``ppermute`` and the running top-K absorbs each visiting shard; then the
latents travel round the ring and each query's online softmax absorbs the selected entries that
belong to the visiting shard (a shard none of a block's selections falls in is skipped). Key
indices are global (``shard * S_local + s``), so the selection equals the unsharded one. No
array anywhere has both a query and a key dimension longer than a block.

Selection carries no gradient (as in the reference, whose indexer runs under ``no_grad``);
gradients reach queries and latents through the attention, and through ``ppermute``'s transpose
round the ring back to the shard that owns them.

Shape letters: B batch, T queries (local to a shard inside ``shard_map``), S keys, K selected
per query, N heads (MLA heads, or indexer heads in the indexer terms), H indexer head dim,
C latent dim (``C + R`` where the rope key rides along), P shards on ``context``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmoe.attention.context_parallel import CONTEXT, context_parallel_size, token_spec

_NEVER = jnp.iinfo(jnp.int32).max  # position of padded keys: visible to no query


@dataclasses.dataclass(frozen=True)
class DSABlocks:
    """Block sizes of :func:`sparse_dsa` (static; results do not depend on them).

    Attributes:
        query_chunk: queries per pass over all keys; the running top-K is ``[B, query_chunk, K]``
            and, under context parallelism, the keys and latents go round the ring once per chunk.
        block_q: queries scored together against a key block.
        block_k: keys per scored block; larger blocks amortise the per-merge ``O(K)`` work.
        group: keys per group in the candidate pre-filter of a merge.
        attn_block_q: queries whose ``K`` selected latents are gathered together.
        min_bucket: smallest candidate count a merge handles (buckets grow by 4x up to K).
    """

    query_chunk: int = 8192
    block_q: int = 256
    block_k: int = 16384
    group: int = 32
    attn_block_q: int = 64
    min_bucket: int = 16

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"DSABlocks.{f.name} must be a positive integer, got {v!r}")


# --------------------------------------------------------------------------------------------
# Mesh helpers


def _varying(x, like):
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
# Streamed top-K


def _buckets(largest: int, smallest: int) -> tuple[int, ...]:
    sizes, m = [], min(smallest, largest)
    while m < largest:
        sizes.append(m)
        m *= 4
    return (*sizes, largest)


def _merge(vals, idx, s, base, *, buckets, group):
    """Running top-K ``(vals, idx)[B, T, K]`` updated with block scores ``s[B, T, S]``.

    ``base`` is the global index of ``s[..., 0]``. Only entries above a query's current K-th
    value can enter; the bucket is the smallest static size holding the most any query has.
    """
    B, T, S = s.shape
    theta = jnp.min(vals, axis=-1, keepdims=True)  # [B, T, 1]; -inf while the set is not full
    need = jnp.max(jnp.sum(s > theta, axis=-1))
    # Bucket i+1 holds up to buckets[i]; more than the largest (only while the set fills up)
    # clamps to it, which is still exact: the top min(K, S) of the block is all that can enter.
    branch = jnp.where(need > 0, 1 + sum((need > b).astype(jnp.int32) for b in buckets[:-1]), 0)

    def keep(vals, idx, s):
        return vals, idx

    def take(M, vals, idx, s):
        if M * group < S:  # pre-filter: the entries above theta lie in at most M groups
            G = S // group
            s_groups = s.reshape(B, T, G, group)
            _, gi = jax.lax.top_k(jnp.max(s_groups, axis=-1), M)  # [B, T, M]
            cand = jnp.take_along_axis(s_groups, gi[..., None], axis=2).reshape(B, T, M * group)
            cand_s = (gi[..., None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(B, T, M * group)
            cv, ci = jax.lax.top_k(cand, M)
            ci = jnp.take_along_axis(cand_s, ci, axis=-1)
        else:
            cv, ci = jax.lax.top_k(s, M)
        neg_low, low = jax.lax.top_k(-vals, M)  # the M smallest of the running set, and their slots
        pool_v = jnp.concatenate([-neg_low, cv], axis=-1)  # [B, T, 2M]
        pool_i = jnp.concatenate([jnp.take_along_axis(idx, low, axis=-1), base + ci], axis=-1)
        best_v, best = jax.lax.top_k(pool_v, M)
        b = jnp.arange(B)[:, None, None]
        t = jnp.arange(T)[None, :, None]
        vals = vals.at[b, t, low].set(best_v)
        idx = idx.at[b, t, low].set(jnp.take_along_axis(pool_i, best, axis=-1))
        return vals, idx

    branches = [keep] + [functools.partial(take, M) for M in buckets]
    return jax.lax.switch(branch, branches, vals, idx, s)


def _select_blocks(run, q_blocks, k_blocks, *, buckets, group):
    """Merges every key block into the running top-K of every query block.

    Args:
        run: ``(vals, idx)``, each ``[nq, B, bq, K]``.
        q_blocks: ``(q [nq, B, bq, N, H], w [nq, B, bq, N], pos [nq, B, bq])``.
        k_blocks: ``(k [nk, B, bk, H], pos [nk, B, bk], base [nk])``.
    """

    def query_block(_, xs):
        vals, idx, q, w, q_pos = xs

        def key_block(carry, ks):
            k, k_pos, base = ks

            def work(carry):
                s = index_scores(q, w, k, q_pos, k_pos)
                return _merge(*carry, s, base, buckets=buckets, group=group)

            return jax.lax.cond(jnp.min(k_pos) <= jnp.max(q_pos), work, lambda c: c, carry), None

        (vals, idx), _ = jax.lax.scan(key_block, (vals, idx), k_blocks)
        return None, (vals, idx)

    _, run = jax.lax.scan(query_block, None, (*run, *q_blocks))
    return run


def streamed_topk(q_index, w_index, q_pos, k_index, k_pos, *, topk: int, blocks: DSABlocks = DSABlocks()):
    """The streamed selection on one device: ``(scores, indices, valid)``, each ``[B, T, K]``.

    Args as :func:`sparse_dsa`. Indices are unsorted; an entry is valid when its key is visible
    (its score finite). Same sets as ``top_k`` over the dense scores when there are no ties.
    """
    B, T = q_pos.shape
    S = k_pos.shape[1]
    K = min(topk, S)
    _, bq, _, bk, group, buckets = _sizes(T, S, K, blocks)
    T_pad, S_pad = _round_up(T, bq), _round_up(S, bk)
    q_blocks = (
        _blocks(_pad(q_index, 1, T_pad, 0), bq),
        _blocks(_pad(w_index.astype(jnp.float32), 1, T_pad, 0), bq),
        _blocks(_pad(q_pos, 1, T_pad, -1), bq),
    )
    k_blocks = (
        _blocks(_pad(k_index, 1, S_pad, 0), bk),
        _blocks(_pad(k_pos, 1, S_pad, _NEVER), bk),
        jnp.arange(S_pad // bk, dtype=jnp.int32) * bk,
    )
    nq = T_pad // bq
    run = (jnp.full((nq, B, bq, K), -jnp.inf, jnp.float32), jnp.zeros((nq, B, bq, K), jnp.int32))
    vals, idx = _select_blocks(run, q_blocks, k_blocks, buckets=buckets, group=group)
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, T_pad, K)[:, :T]  # noqa: E731
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


def _sizes(T, S, K, blocks: DSABlocks):
    """Block sizes fitted to the arrays: ``bq | chunk``, ``ba | bq``, ``group | bk``."""
    bq = min(blocks.block_q, T)
    ba = min(blocks.attn_block_q, bq)
    bq = _round_up(bq, ba)
    chunk = _round_up(min(blocks.query_chunk, _round_up(T, bq)), bq)
    group = min(blocks.group, S)
    bk = _round_up(min(blocks.block_k, _round_up(S, group)), group)
    buckets = _buckets(min(K, bk), blocks.min_bucket)
    return chunk, bq, ba, bk, group, buckets


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
    chunk, bq, ba, bk, group, buckets = _sizes(T, S, K, blocks)
    T_pad, S_pad = _round_up(T, chunk), _round_up(S, bk)
    nq, na = chunk // bq, chunk // ba
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
    keys = (_blocks(_pad(k_index, 1, S_pad, 0), bk), _blocks(_pad(k_pos, 1, S_pad, _NEVER), bk))
    block_starts = jnp.arange(S_pad // bk, dtype=jnp.int32) * bk
    perm = [(i, (i + 1) % ring) for i in range(ring)]

    def select(q_idx, w_idx, qp):
        vals = _varying(jnp.full((nq, B, bq, K), -jnp.inf, jnp.float32), q_idx)
        idx = _varying(jnp.zeros((nq, B, bq, K), jnp.int32), q_idx)

        def visit(carry, step):
            run, ks = carry
            base = ((shard - step) % ring) * S  # the visiting shard's first global index
            run = _select_blocks(run, (q_idx, w_idx, qp), (*ks, base + block_starts), buckets=buckets, group=group)
            if ring > 1:
                ks = jax.lax.ppermute(ks, CONTEXT, perm)
            return (run, ks), None

        (run, _), _ = jax.lax.scan(visit, ((vals, idx), keys), jnp.arange(ring))
        return run

    def attend(q, sel):
        f32 = jnp.float32
        m = _varying(jnp.full((na, B, ba, N), -jnp.inf, f32), q)
        state = (
            m,
            _varying(jnp.zeros((na, B, ba, N), f32), q),
            _varying(jnp.zeros((na, B, ba, N, latent_dim), f32), q),
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
        w_index: ``[B, T, NI]`` indexer head weights, scales folded in (see :func:`index_scores`).
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
    ring = context_parallel_size()
    kw = dict(topk=topk, scale=scale, latent_dim=latent_dim, blocks=blocks)
    if ring == 1:
        return _dsa_shard(idx_in[0], idx_in[1], q_cat, q_pos, idx_in[2], latents, k_pos, ring=1, **kw)
    for name, a in (("q_cat", q_cat), ("latents", latents)):
        if a.shape[1] % ring:
            raise ValueError(
                f"DSA context parallelism: {name} has sequence length {a.shape[1]}, which must be a multiple "
                f"of the mesh's 'context' axis size {ring}"
            )
    args = (idx_in[0], idx_in[1], q_cat, q_pos, idx_in[2], latents, k_pos)
    fn = functools.partial(_dsa_shard, ring=ring, **kw)
    in_specs = tuple(token_spec(a.shape[0], a.ndim) for a in args)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=token_spec(q_cat.shape[0], 4))(*args)
