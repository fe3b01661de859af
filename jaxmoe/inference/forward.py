"""The model's forward over the engine's pools: chunked prefill and one-token decode, per kind.

A step's tokens come in *groups* (:class:`Rows`), each a padded ``[B, T]`` block: the decode
group (T = 1, one new token per running sequence) and the prefill group (T up to the chunk
size, a slice of one prompt per row). Token-wise work (norms, projections, the MoE) runs on all
of a step's tokens at once, so the MoE routes them together as in training (dropless). Attention
runs per group, against the pools (read here; the new entries are stored by :func:`write`):

- ``mla``: the queries attend to the row's pages plus the new tokens' own latents, in the
  absorbed form (MQA over the latent: per-head K/V are never built).
- ``dsa``: the indexer scores every cached key of the row (and the new ones), the exact top-k
  is taken, and the absorbed attention reads only those latents.
- ``kda``: the row's slot state is the initial state; prefill runs the chunked delta rule
  (padding tokens neither decay nor write), decode the recurrent step; the new state is stored.

Shape letters: B rows, T new tokens per row, M pages per row, P page size, S = M * P cached
positions a row can see, D model dim, V vocab, W latent width, C kv latent dim, K top-k.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.attention.dsa_topk import index_scores
from jaxmoe.attention.kda import KDAState
from jaxmoe.attention.mla import softmax_scale
from jaxmoe.inference.cache import CacheSpec


class Rows(NamedTuple):
    """One group of a step: B rows of up to T new tokens each.

    Attributes:
      tokens: ``[B, T]`` int32 new tokens, row ``b`` valid in ``[0, length[b])``.
      start: ``[B]`` int32 tokens of the row's sequence already in the pools (the position of
        ``tokens[b, 0]``).
      length: ``[B]`` int32 valid new tokens; 0 for a padding row.
      pages: ``[B, M]`` int32 the row's page table (null page 0 past its pages).
      slot: ``[B]`` int32 the row's KDA slot; out of range (``num_slots``) for a padding row.
      embeds: ``[B, T, D]`` float32 input embeddings of image tokens (the vision tower's merged
        features, computed once per image at submission), or None: a step without image tokens.
      from_image: ``[B, T]`` bool: the tokens whose input is ``embeds`` (their ids are placeholders).
    """

    tokens: jax.Array
    start: jax.Array
    length: jax.Array
    pages: jax.Array
    slot: jax.Array
    embeds: jax.Array | None = None
    from_image: jax.Array | None = None

    def inputs(self, model) -> jax.Array:
        """``[B, T, D]`` the new tokens' input embeddings, image features at image tokens."""
        x = model.embed_tokens(self.tokens)
        if self.embeds is None:
            return x
        return jnp.where(self.from_image[..., None], self.embeds.astype(x.dtype), x)

    def positions(self) -> jax.Array:
        """``[B, T]`` absolute positions of the new tokens."""
        return self.start[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None]

    def valid(self) -> jax.Array:
        """``[B, T]`` bool: real tokens (not padding)."""
        return jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None] < self.length[:, None]


def _pool_rows(pages: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """The flat pool rows (``page * P + offset``) of ``positions[B, ...]`` through the page tables ``pages[B, M]``."""
    B, M = pages.shape
    page = jnp.take_along_axis(pages, jnp.clip(positions // page_size, 0, M - 1).reshape(B, -1), axis=1)
    return page.reshape(positions.shape) * page_size + positions % page_size


def _write_rows(rows: Rows, page_size: int, num_pages: int) -> jax.Array:
    """``[B, T]`` flat pool rows the new tokens are written to; ``G * P`` (dropped) for padding."""
    flat = _pool_rows(rows.pages, rows.positions(), page_size)
    return jnp.where(rows.valid(), flat, num_pages * page_size)


def _read(pool: jax.Array, new: jax.Array, rows: Rows) -> jax.Array:
    """Every row's entries ``[B, S, W]`` (position ``s`` at index ``s``): its pages, with ``new[B, T, W]`` laid over.

    The step only reads the pools; :func:`write` stores the new entries afterwards, in a program
    of its own that updates the donated pools in place (a gather and a scatter on one pool in one
    program made XLA copy the whole pool, every layer, every step).
    """
    G, P, W = pool.shape
    B, M = rows.pages.shape
    seen = pool[rows.pages].reshape(B, M * P, W)  # [B, M, P, W] -> [B, S, W]
    at = jnp.where(rows.valid(), rows.positions(), M * P)  # [B, T]; padding dropped
    return seen.at[jnp.arange(B)[:, None], at].set(new.astype(pool.dtype), mode="drop")


def _read_selected(pool: jax.Array, new: jax.Array, rows: Rows, indices: jax.Array) -> jax.Array:
    """``[B, T, K, W]``: what :func:`_read` holds at positions ``indices[B, T, K]``, read only there.

    A position below the row's ``start`` comes from its page, one at or above it from ``new``.
    (Past the row's new tokens the two differ, but no query sees those positions.) A DSA decode
    step so reads its top-k latents, not every cached one: at a 1M-token context the latent
    pages are ~4x the indexer keys that it must score all of.
    """
    G, P, W = pool.shape
    T = new.shape[1]
    from_pages = pool.reshape(G * P, W)[_pool_rows(rows.pages, indices, P)]
    rel = indices - rows.start[:, None, None]  # [B, T, K] index into the new tokens
    from_new = jax.vmap(lambda n, r: n[jnp.clip(r, 0, T - 1)])(new.astype(pool.dtype), rel)
    return jnp.where((rel >= 0)[..., None], from_new, from_pages)


def _kv_positions(seen: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(seen.shape[1], dtype=jnp.int32), seen.shape[:2])  # [B, S]


def _latent(attn, x: jax.Array, pos: jax.Array) -> jax.Array:
    c_kv, k_rope = attn.latents(x, pos)
    return jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)  # [B, T, C + R]


# Cached positions (all rows of the decode group together) that one step of the decode attention's loop reads.
DECODE_BLOCK_TOKENS = 4096


def decode_latent_attention(
    attn, x: jax.Array, rows: Rows, pool: jax.Array, new: jax.Array, q_latent=None, block_tokens=DECODE_BLOCK_TOKENS
):
    """A decode group's absorbed attention (one new token a row) to its cached positions and itself.

    The same attention as :meth:`MLA.attend_latent` over the row's pages with ``new`` laid over
    (what the prefill group does), computed block by block with an online softmax: each step of a
    loop gathers the next ``block_tokens // B`` positions of every row, scores them
    against the query ``[absorbed q_nope, q_rope]`` (the whole stored latent, ``c_kv`` and rope key,
    width ``W = C + R``), and folds them into the running max, denominator and weighted sum. The
    loop stops after the block holding the longest row's last cached position, so the page table's
    padding (up to its power-of-two width) is never read, and a block of latents is scored and
    summed while it is still in cache: gathering all ``S`` positions first wrote and re-read a
    ``[B, S, W]`` copy three times, and its fresh temporaries page-faulted on every step. Measured
    on a 2-core host (benchmarks/decode.py, one row at 64K cached tokens): 78 ms -> 21 ms.

    Args:
      attn: the layer's :class:`jaxmoe.attention.MLA` (or DSA in its dense warm-up).
      x: ``[B, 1, D]`` normed layer input of the new tokens.
      rows: the group.
      pool: ``[G, P, W]`` the layer's latent pages.
      new: ``[B, 1, W]`` the new tokens' latents.
      q_latent: the q latent when the caller has it (DSA).
      block_tokens: positions (all rows together) a step of the loop reads, rounded to whole pages.

    Returns:
      ``y[B, 1, D]``.
    """
    G, P, W = pool.shape
    B, M = rows.pages.shape
    C = attn.cfg.mla.kv_lora_rank
    K = math.gcd(M, 1 << max(1, block_tokens // (B * P)).bit_length() - 1)  # pages a row per block, dividing M
    with jax.named_scope("mla_decode"):
        q_nope, q_rope = attn.queries(x, rows.positions(), q_latent)
        q = jnp.concatenate([attn.absorb_query(q_nope), q_rope.astype(q_nope.dtype)], axis=-1)[:, 0]  # [B, N, W]
        q = q * softmax_scale(attn.cfg)
        new = new[:, 0].astype(pool.dtype)  # [B, W]
        own = rows.length[:, None] > 0  # [B, 1]: a padding row attends to nothing
        m = jnp.where(own, jnp.einsum("BW,BNW->BN", new, q, preferred_element_type=jnp.float32), -jnp.inf)  # [B, N]
        denom = jnp.broadcast_to(own, m.shape).astype(jnp.float32)
        acc = jnp.broadcast_to(jnp.where(own[..., None], new[:, None], 0), (*m.shape, W)).astype(jnp.float32)
        blocks = rows.pages.reshape(B, M // K, K)

        def block(j, carry):
            m, denom, acc = carry  # [B, N], [B, N], [B, N, W]
            kv = jnp.take(pool, blocks[:, j], axis=0, mode="clip").reshape(B, K * P, W)
            seen = j * K * P + jnp.arange(K * P, dtype=jnp.int32)[None] < rows.start[:, None]  # [B, K * P]
            s = jnp.einsum("BSW,BNW->BSN", kv, q, preferred_element_type=jnp.float32)
            s = jnp.where(seen[..., None], s, -jnp.inf)
            top = jnp.maximum(m, jnp.max(s, axis=1))
            top_ = jnp.where(jnp.isfinite(top), top, 0.0)
            rescale = jnp.exp(m - top_)  # 0 where nothing was seen yet (m = -inf)
            p = jnp.exp(s - top_[:, None])  # masked: exp(-inf) = 0
            acc = acc * rescale[..., None] + jnp.einsum(
                "BSN,BSW->BNW", p.astype(pool.dtype), kv, preferred_element_type=jnp.float32
            )
            return top, denom * rescale + jnp.sum(p, axis=1), acc

        needed = (jnp.max(rows.start) + K * P - 1) // (K * P)
        _, denom, acc = jax.lax.fori_loop(0, jnp.minimum(needed, M // K), block, (m, denom, acc))
        o = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [B, N, W]
        return attn.output_from_latent(o[:, None, :, :C].astype(q_nope.dtype))


def _latent_attention(attn, x: jax.Array, rows: Rows, pool: jax.Array, new: jax.Array, q_latent=None) -> jax.Array:
    """Absorbed attention of the group's new tokens to the row's pages and to each other."""
    if x.shape[1] == 1:
        return decode_latent_attention(attn, x, rows, pool, new, q_latent)
    pos = rows.positions()
    seen = _read(pool, new, rows)
    C = attn.cfg.mla.kv_lora_rank
    return attn.attend_latent(x, pos, seen[..., :C], seen[..., C:], _kv_positions(seen))


def mla_rows(attn, x: jax.Array, rows: Rows, pool: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An ``mla`` layer (or a ``dsa`` layer in its dense warm-up) over its latent pages.

    Args:
      attn: the layer's :class:`jaxmoe.attention.MLA`.
      x: ``[B, T, D]`` normed layer input of the new tokens.
      rows: the group.
      pool: ``[G, P, W]`` the layer's latent pages.

    Returns:
      ``y[B, T, D]`` and the new tokens' latents ``[B, T, W]`` (for :func:`write`).
    """
    new = _latent(attn, x, rows.positions())
    return _latent_attention(attn, x, rows, pool, new), new


def dsa_rows(attn, x: jax.Array, rows: Rows, pool: jax.Array, index_pool: jax.Array):
    """A ``dsa`` layer: indexer over every cached key of the row, exact top-k, sparse attention.

    Returns:
      ``y[B, T, D]``, the new latents ``[B, T, W]`` and indexer keys ``[B, T, I]``.
    """
    pos = rows.positions()
    q_latent = attn.query_latent(x)
    new_keys = attn.indexer.keys(x, pos)  # stored in the dense warm-up too: the sparse stage reads them
    new = _latent(attn, x, pos)
    if attn.dense_attention:
        return _latent_attention(attn, x, rows, pool, new, q_latent), new, new_keys
    with jax.named_scope("indexer"):
        q_index, w_index = attn.indexer.query_terms(x, q_latent, pos)
        keys = _read(index_pool, new_keys, rows)
        kv_pos = _kv_positions(keys)
    with jax.named_scope("indexer_topk"):
        scores = index_scores(q_index, w_index, keys, pos, kv_pos)  # [B, T, S]
        K = min(attn.cfg.indexer.topk, scores.shape[-1])
        _, indices = jax.lax.top_k(scores, K)  # ties: lowest position first, as the reference
        valid = indices <= pos[:, :, None]
    q_nope, q_rope = attn.queries(x, pos, q_latent)
    y, _ = attn.attend_gathered(q_nope, q_rope, _read_selected(pool, new, rows, indices), valid)
    return y, new, new_keys


def kda_rows(attn, x: jax.Array, rows: Rows, conv: jax.Array, state: jax.Array):
    """A ``kda`` layer on the rows' slots: chunked prefill, or the recurrent step when T == 1.

    A row whose ``start`` is 0 begins from the zero state whatever its slot holds.

    Returns:
      ``y[B, T, D]`` and the rows' new ``conv[B, K-1, 3, N, H]`` and ``state[B, N, H, V]``.
    """
    fresh = (rows.start == 0)[:, None, None, None]
    conv0 = jnp.where(fresh[..., None], 0, conv.at[rows.slot].get(mode="fill", fill_value=0))
    state0 = jnp.where(fresh, 0, state.at[rows.slot].get(mode="fill", fill_value=0))
    initial = KDAState(conv0.astype(conv.dtype), state0.astype(jnp.float32))
    if x.shape[1] == 1:
        y, new = attn.step(x, initial)
    else:
        y, new = attn.forward_with_state(x, initial, lengths=rows.length)
    return y, new.conv.astype(conv.dtype), new.recurrent


def _attention(layer, i: int, spec: CacheSpec, x: jax.Array, rows: Rows, cache: dict, writes: dict) -> jax.Array:
    """Layer ``i``'s attention on one group; what it must store goes to ``writes[pool][layer]``."""
    kind = layer.kind
    if kind == "kda":
        j = spec.kda_layers.index(i)
        y, conv, state = kda_rows(layer.attn, x, rows, cache["conv"][j], cache["state"][j])
        writes["conv"][j].append(conv)
        writes["state"][j].append(state)
        return y
    j = spec.latent_layers.index(i)
    if kind == "dsa":
        d = spec.index_layers.index(i)
        y, new, keys = dsa_rows(layer.attn, x, rows, cache["latent"][j], cache["index"][d])
        writes["index"][d].append(keys)
    else:
        y, new = mla_rows(layer.attn, x, rows, cache["latent"][j])
    writes["latent"][j].append(new)
    return y


def forward(
    model, spec: CacheSpec, cache: dict, groups: tuple[Rows, ...], tokens: int | None = None
) -> tuple[list[jax.Array], dict]:
    """Every layer over the groups' new tokens, reading the pools.

    Args:
      model: the :class:`jaxmoe.model.Transformer`.
      spec: the pools' :class:`CacheSpec`.
      cache: the pools (as :meth:`CacheSpec.init` makes them); not modified.
      groups: the step's groups (empty groups are left out by the caller).
      tokens: the most real (``valid``) tokens the groups hold together, or None. When the groups'
        padded ``B * T`` exceed it, each layer's FFN runs on the real tokens only, gathered into
        ``tokens`` slots (the step's token budget; a prefill group's short rows are mostly padding:
        the first step of the decode benchmark holds 512 real tokens in 2,048). More real tokens
        than ``tokens`` would be dropped: the caller checks (:meth:`Engine.run_arrays`).

    Returns:
      per group the final-norm hidden states ``[B, T, D]``, and the writes for :func:`write`:
      ``{pool: [per layer of the pool: [per group: new entries]]}``.
    """
    writes = {k: [[] for _ in v] for k, v in cache.items()}
    xs = [g.inputs(model) for g in groups]
    sizes = [x.shape[0] * x.shape[1] for x in xs]
    N, D = sum(sizes), model.cfg.d_model
    keep = None  # [tokens]: the flat indices of the real tokens, then N (no token)
    if tokens is not None and tokens < N:
        valid = jnp.concatenate([g.valid().reshape(-1) for g in groups])
        keep = jnp.nonzero(valid, size=tokens, fill_value=N)[0]
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            xs = [x + _attention(layer, i, spec, layer.attn_norm(x), g, cache, writes) for x, g in zip(xs, groups)]
            # The FFN sees all of the step's tokens at once, [N, 1, D] (or its real ones, [tokens, 1, D]).
            flat = jnp.concatenate([x.reshape(-1, 1, D) for x in xs], axis=0)
            if keep is None:
                flat = flat + layer.ffn(layer.ffn_norm(flat))
            else:  # padding tokens keep their (unused) input
                real = jnp.take(flat, keep, axis=0, mode="fill", fill_value=0)
                flat = flat.at[keep].add(layer.ffn(layer.ffn_norm(real)).astype(flat.dtype), mode="drop")
            parts = jnp.split(flat, np.cumsum(sizes)[:-1].tolist(), axis=0)
            xs = [p.reshape(x.shape) for p, x in zip(parts, xs)]
    return [model.final_norm(x) for x in xs], writes


def write(cache: dict, groups: tuple[Rows, ...], writes: dict) -> dict:
    """Stores a step's new entries: latents and indexer keys into pages, KDA states into slots."""
    out = {}
    for kind in ("latent", "index"):
        out[kind] = []
        for pool, news in zip(cache[kind], writes[kind]):
            G, P, W = pool.shape
            flat = pool.reshape(G * P, W)
            for rows, new in zip(groups, news):
                flat = flat.at[_write_rows(rows, P, G)].set(new.astype(pool.dtype), mode="drop")
            out[kind].append(flat.reshape(G, P, W))
    for kind in ("conv", "state"):
        out[kind] = []
        for pool, news in zip(cache[kind], writes[kind]):
            for rows, new in zip(groups, news):
                pool = pool.at[rows.slot].set(new.astype(pool.dtype), mode="drop")
            out[kind].append(pool)
    return out


def last_hidden(h: jax.Array, rows: Rows) -> jax.Array:
    """``h[B, T, D]`` at each row's last new token -> ``[B, D]``."""
    idx = jnp.clip(rows.length - 1, 0, h.shape[1] - 1)
    return jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]
