"""The engine's device memory: one pool per kind of per-sequence state, allocated once.

| kind  | per token                              | per sequence                      | pool            |
|-------|----------------------------------------|-----------------------------------|-----------------|
| mla   | latent ``c_kv[C]`` + rope key ``[R]``  | --                                | pages           |
| dsa   | the same latent + indexer key ``[HI]`` | --                                | pages (same ids)|
| kda   | --                                     | conv tail + delta-rule state      | slots           |

A page holds ``page_size`` consecutive positions of one sequence in every latent layer (and
every indexer layer) at once: one page id, one row of every layer's pool, so a sequence needs a
single page table. Token ``i`` of a sequence lives at flat row ``page_table[i // P] * P + i % P``.
Page 0 is the null page: never handed out, always zero, what padding entries of a page table
point at. KDA state is O(1) in the length, so it lives in slots, one per running sequence (and
one per prefix snapshot, see :mod:`jaxmoe.inference.prefix`).

Page size: 16 positions by default. A sequence wastes at most ``P - 1`` positions in its last
page, so the held/ideal bytes ratio is about ``1 + P / (2 L)`` for sequences of mean length L
(within 10% for L >= 80 at P = 16), while a decode step gathers whole pages (16 latents of 576
bytes in bf16 in the target: 9 KB contiguous per page read, large enough for DMA efficiency).

Shape letters: L layers of a kind, G pages, P positions per page, W latent width (C + R),
I indexer key width, Z slots, K conv kernel, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig

NULL_PAGE = 0
DEFAULT_PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Shapes of the pools; everything the engine needs to size and address them.

    Attributes:
      page_size: P, positions per page.
      num_pages: G, pages per pool including the null page 0.
      num_slots: Z, KDA slots (running sequences and prefix snapshots).
      latent_layers: model layer indices that keep latent pages (``mla`` and ``dsa``).
      index_layers: model layer indices that keep indexer-key pages (``dsa``).
      kda_layers: model layer indices that keep slots (``kda``).
    """

    page_size: int
    num_pages: int
    num_slots: int
    latent_layers: tuple[int, ...]
    index_layers: tuple[int, ...]
    kda_layers: tuple[int, ...]
    latent_width: int
    index_width: int
    conv_shape: tuple[int, ...]  # [K-1, 3, N, H]
    state_shape: tuple[int, ...]  # [N, H, V]
    dtype: str

    @staticmethod
    def for_model(cfg: ModelConfig, *, num_pages: int, num_slots: int, page_size: int = DEFAULT_PAGE_SIZE):
        kinds = cfg.layer_kinds
        kc = cfg.kda
        return CacheSpec(
            page_size=page_size,
            num_pages=num_pages,
            num_slots=num_slots,
            latent_layers=tuple(i for i, k in enumerate(kinds) if k in ("mla", "dsa")),
            index_layers=tuple(i for i, k in enumerate(kinds) if k == "dsa"),
            kda_layers=tuple(i for i, k in enumerate(kinds) if k == "kda"),
            latent_width=cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim,
            index_width=cfg.indexer.head_dim,
            conv_shape=(kc.conv_kernel - 1, 3, kc.num_heads, kc.head_dim),
            state_shape=(kc.num_heads, kc.head_dim, kc.head_dim),
            dtype=cfg.dtype,
        )

    @staticmethod
    def from_budget(
        cfg: ModelConfig, cache_bytes: int, *, num_slots: int, page_size: int = DEFAULT_PAGE_SIZE
    ) -> CacheSpec:
        """The spec whose pools fill ``cache_bytes``: ``num_slots`` slots first, pages with the rest.

        Raises:
          ValueError: naming the budget when it does not hold the slots and two pages.
        """
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        probe = CacheSpec.for_model(cfg, num_pages=1, num_slots=num_slots, page_size=page_size)
        slots = num_slots * probe.bytes_per_slot
        per_page = probe.bytes_per_page
        # Without mla/dsa layers a page holds no bytes: give every slot a full context's page table.
        num_pages = (cache_bytes - slots) // per_page if per_page else num_slots * -(-cfg.max_context // page_size) + 1
        if num_pages < 2:
            raise ValueError(
                f"cache budget {cache_bytes} bytes holds {num_slots} KDA slots ({slots} bytes) but not two pages of "
                f"{per_page} bytes; raise --cache-gb or lower the slot count"
            )
        return CacheSpec.for_model(cfg, num_pages=int(num_pages), num_slots=num_slots, page_size=page_size)

    @property
    def token_bytes(self) -> int:
        """Ideal bytes of cache per live token: every latent and indexer key of every layer."""
        item = jnp.dtype(self.dtype).itemsize
        return item * (len(self.latent_layers) * self.latent_width + len(self.index_layers) * self.index_width)

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def bytes_per_slot(self) -> int:
        item = jnp.dtype(self.dtype).itemsize
        per_layer = item * int(np.prod(self.conv_shape)) + 4 * int(np.prod(self.state_shape))
        return len(self.kda_layers) * per_layer

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.num_slots * self.bytes_per_slot

    def init(self, sharding: jax.sharding.Sharding | None = None) -> dict[str, list[jax.Array]]:
        """Zeroed pools: ``latent``/``index`` lists of ``[G, P, W]``/``[G, P, I]``, ``conv``/``state`` of slots."""
        dt = jnp.dtype(self.dtype)
        G, P, Z = self.num_pages, self.page_size, self.num_slots

        def zeros(shape, dtype):
            return jnp.zeros(shape, dtype, device=sharding)

        return {
            "latent": [zeros((G, P, self.latent_width), dt) for _ in self.latent_layers],
            "index": [zeros((G, P, self.index_width), dt) for _ in self.index_layers],
            "conv": [zeros((Z, *self.conv_shape), dt) for _ in self.kda_layers],
            "state": [zeros((Z, *self.state_shape), jnp.float32) for _ in self.kda_layers],
        }


def _zero_rows(pool: jax.Array, ids: jax.Array) -> jax.Array:
    """``pool[ids] = 0`` for in-range ids; out-of-range ids (padding) are dropped."""
    return pool.at[ids].set(jnp.zeros((), pool.dtype), mode="drop")


def _copy_rows(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    return pool.at[dst].set(pool[jnp.clip(src, 0, pool.shape[0] - 1)], mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def _maintain(cache, zero_pages, zero_slots, copy_pages, copy_slots):
    paged = {k: [_zero_rows(_copy_rows(a, *copy_pages), zero_pages) for a in cache[k]] for k in ("latent", "index")}
    slotted = {k: [_zero_rows(_copy_rows(a, *copy_slots), zero_slots) for a in cache[k]] for k in ("conv", "state")}
    return paged | slotted


def maintenance(spec: CacheSpec, *, zero_pages=(), zero_slots=(), copy_pages=(), copy_slots=()) -> tuple:
    """Host arrays for :func:`maintain`: freed pages and slots to zero, ``(src, dst)`` pages and slots to copy.

    Every list is padded with out-of-range ids (dropped) to one size, the power of two (at least
    8) at or above the longest, so the program compiles for a handful of sizes only, one for each
    (:func:`warm_maintenance` compiles them ahead).
    """
    longest = max(len(zero_pages), len(zero_slots), len(copy_pages), len(copy_slots), 1)
    n = max(8, 1 << (longest - 1).bit_length())

    def ids(values, limit):
        out = np.full((n,), limit, np.int32)
        out[: len(values)] = values
        return out

    G, Z = spec.num_pages, spec.num_slots
    return (
        ids(list(zero_pages), G),
        ids(list(zero_slots), Z),
        ids([s for s, _ in copy_pages], G),
        ids([d for _, d in copy_pages], G),
        ids([s for s, _ in copy_slots], Z),
        ids([d for _, d in copy_slots], Z),
    )


def warm_maintenance(cache, spec: CacheSpec, pages: int):
    """Runs :func:`maintain` with nothing to do for each list size up to ``pages`` (what one
    sequence frees), so that its programs compile before any step needs them; returns the cache,
    committed to its devices as a step's outputs are (jit compiles again for uncommitted arrays)."""
    cache = jax.device_put(cache, jax.tree.map(lambda a: a.sharding, cache))
    n = 8
    while True:
        cache = maintain(cache, maintenance(spec, zero_pages=[spec.num_pages] * n))
        if n >= pages:
            return cache
        n *= 2


def maintain(cache, arrays: tuple):
    """Copies pages and slots, then zeroes freed ones (one program; see :func:`maintenance`).

    Copies read before the zeroing, so a slot freed in this step (a preempted sequence) can still
    be the source of a prefix snapshot; a copy's destination is overwritten whole and is never in
    the zeroing lists (:meth:`Scheduler.schedule` leaves it out).
    """
    zero_pages, zero_slots, page_src, page_dst, slot_src, slot_dst = arrays
    return _maintain(cache, zero_pages, zero_slots, (page_src, page_dst), (slot_src, slot_dst))
