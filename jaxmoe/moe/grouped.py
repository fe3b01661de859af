"""Grouped matmul ``[M, I] x [E, I, O] -> [M, O]``: rows sorted by group, group ``e`` uses ``w[e]``.

Shapes: M rows, I input dim, O output dim, E groups (experts), B rows per tile, T tile slots.

Two implementations of the contract of ``jax.lax.ragged_dot``:

- ``"ragged"``: ``jax.lax.ragged_dot`` itself, which TPU and GPU lower to grouped kernels.
- ``"blocked"``: for XLA:CPU, where ``ragged_dot`` is ~30x slower than a batched matmul of the
  same work. Each group's rows are cut into tiles of ``B`` rows (its last tile partial), which
  is the padded layout "every group padded to a multiple of ``B``" without materialising it: a
  tile is a contiguous ``B``-row window of ``x``, so no rows are gathered or scattered. A loop
  over the ``sum(ceil(group_sizes / B)) <= M // B + E`` tiles in use multiplies each window by
  its group's weight (a dynamic slice of ``w``: never a copy of ``w`` per tile) and writes back
  only the rows the tile owns. Dropless, static shapes, and exact: every output row is the same
  dot product as in ``ragged_dot``; rows no tile owns (beyond ``sum(group_sizes)``) stay zero.
  Its reverse-mode rule is written out: ``dx`` is the same loop with ``w`` transposed, and
  ``dw[e]`` accumulates ``x_tile^T dy_tile`` over group ``e``'s tiles in place (autodiff of the
  loop would instead add a full ``[E, I, O]`` zero-padded update per tile).

  Measured (``benchmarks/grouped_matmul.py``, M=16384, I=256, O=128, E=16), time over a dense
  batched matmul of the same work: ~1.2x on 1 CPU core, ~2x on 2 (``ragged_dot``: ~25-35x).
  Each tile's matmul is too small to spread over many cores, so on 16 cores it is ~8x (still
  ~5x faster than ``ragged_dot`` there).

``"auto"`` picks ``"ragged"`` on TPU and GPU and ``"blocked"`` elsewhere.

MXFP4 weights (``w`` a :class:`jaxmoe.quant.QArray` of logical shape ``[E, I, O]``, packed
``[E, O, I/32, 16]``) always take the tile loop, on every backend: a tile dequantizes only its
own group's ``[O, I]`` weight, and consecutive tiles of one group reuse it (tiles are sorted by
group), so each expert in use is dequantized once per matmul and never more than one expert is
held in full precision. (``ragged_dot`` would need all ``E`` experts dequantized at once.) The
reverse-mode rule gives ``dx`` by the same loop; the packed weight is frozen (no ``dw``).

Inside ``jax.shard_map`` the operands are first cast to vary over the same mesh axes (the union
of theirs), so the loops' zero-initialised carries can start with the type their updates have;
where a weight is replicated over an axis the tokens are split on, the cast's transpose sums
``dw`` over that axis, as autodiff of ``ragged_dot`` does.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.quant import mxfp4
from jaxmoe.quant.qarray import QArray
from jaxmoe.sharding import mesh_platform

IMPLS = ("auto", "ragged", "blocked")


def default_block(m: int, num_groups: int) -> int:
    """Rows per tile for ``"blocked"``: the largest power of two <= the mean group size, in [8, 256].

    Larger tiles make fewer, bigger matmuls, but a group's partial last tile wastes up to
    ``block - 1`` rows of work; on CPU the time is flat from 64 to 512 rows at 1024 rows per
    group and rises steeply once tiles exceed the mean group size.
    """
    mean = max(m / max(num_groups, 1), 1.0)
    return int(min(max(2 ** math.floor(math.log2(mean)), 8), 256))


def grouped_matmul(
    x_sorted: jax.Array,
    w: jax.Array | QArray,
    group_sizes: jax.Array,
    *,
    impl: str = "auto",
    block: int | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> jax.Array:
    """``out[i] = x_sorted[i] @ w[g(i)]`` where row ``i`` lies in group ``g(i)``.

    Args:
      x_sorted: ``[M, I]`` rows sorted by group: the first ``group_sizes[0]`` rows are group 0, ...
      w: ``[E, I, O]`` one weight per group, same dtype as ``x_sorted``; or a QArray of that
        logical shape contracting over ``I`` (dequantized to ``x_sorted.dtype`` one group at a time).
      group_sizes: ``[E]`` int32 rows per group; ``sum(group_sizes) <= M``.
      impl: ``"auto"``, ``"ragged"`` (``jax.lax.ragged_dot``) or ``"blocked"`` (see module doc).
      block: rows per tile for ``"blocked"``; default :func:`default_block`.
      precision: passed to the matmuls.

    Returns:
      ``[M, O]`` in ``x_sorted.dtype``; rows at and beyond ``sum(group_sizes)`` are zero.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if isinstance(w, QArray):
        return _grouped_quantized(x_sorted, w, group_sizes, block, precision)
    if x_sorted.ndim != 2 or w.ndim != 3 or x_sorted.shape[1] != w.shape[1]:
        raise ValueError(f"x_sorted [M, I] and w [E, I, O] do not match: {x_sorted.shape}, {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape [E]=({w.shape[0]},), got {group_sizes.shape}")
    if impl == "auto":
        impl = "ragged" if mesh_platform() in ("tpu", "gpu") else "blocked"
    if impl == "ragged":
        return jax.lax.ragged_dot(x_sorted, w, group_sizes, precision=precision)
    x_sorted, w, group_sizes = _same_varying(x_sorted, w, group_sizes)
    block = default_block(x_sorted.shape[0], w.shape[0]) if block is None else int(block)
    if block < 1:
        raise ValueError(f"block must be a positive number of rows, got {block}")
    if x_sorted.shape[0] == 0:
        return jnp.zeros((0, w.shape[2]), jnp.result_type(x_sorted.dtype, w.dtype))
    return _blocked(x_sorted, w, group_sizes.astype(jnp.int32), block, precision)


def _same_varying(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``arrays``, each cast to vary over every manual mesh axis any of them varies over.

    A loop carry must keep one type, and a carry started from zeros varies over no axis; with
    all operands varying alike, :func:`_varying_as` gives the carry the type its updates
    have. Outside ``jax.shard_map`` nothing varies and the arrays come back unchanged.
    """
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))

    def cast(a):
        missing = tuple(sorted(axes - jax.typeof(a).manual_axis_type.varying))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return tuple(cast(a) for a in arrays)


def _varying_as(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` (varying over no mesh axis) cast to vary over the mesh axes ``like`` varies over."""
    axes = tuple(sorted(jax.typeof(like).manual_axis_type.varying))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


# ------------------------------------------------------------------------------------------
# "blocked"


class _Tiles(NamedTuple):
    """Group ``e``'s rows cut into ``ceil(group_sizes[e] / B)`` tiles of ``B`` rows; int32 ``[T]`` each."""

    group: jax.Array  # the tile's group
    start: jax.Array  # its first row
    end: jax.Array  # one past its group's last row (the tile's last rows may lie beyond it)
    count: jax.Array  # []: tiles in use; the rest of the T = M // B + E slots are unused


def _tiles(group_sizes: jax.Array, m: int, b: int) -> _Tiles:
    E = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)  # [E]
    starts = ends - group_sizes  # [E]
    tiles_per_group = -(-group_sizes // b)  # [E]
    tile_ends = jnp.cumsum(tiles_per_group)  # [E]
    t = jnp.arange(m // b + E, dtype=jnp.int32)  # [T]: a static bound on the tiles in use
    # side="right" skips empty groups, which own no tiles.
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), E - 1).astype(jnp.int32)  # [T]
    start = starts[group] + (t - (tile_ends - tiles_per_group)[group]) * b  # [T]
    return _Tiles(group, start.astype(jnp.int32), ends[group].astype(jnp.int32), tile_ends[-1].astype(jnp.int32))


def _tile_rows(tiles: _Tiles, i, m: int, b: int) -> tuple[jax.Array, jax.Array]:
    """Tile ``i``'s ``B``-row window ``[lo, lo + B)`` inside ``[0, M)`` and which of its rows it owns.

    The window is shifted back from the tile's start where it would run past row ``M``, so
    every window is a static-size slice; only rows in ``[start, end)`` are the tile's.
    """
    lo = jnp.minimum(tiles.start[i], m - b)
    rows = lo + jnp.arange(b, dtype=jnp.int32)  # [B]
    return lo, (rows >= tiles.start[i]) & (rows < tiles.end[i])


def _tiled_matmul(x: jax.Array, w: jax.Array, tiles: _Tiles, b: int, precision, transpose_w: bool) -> jax.Array:
    """``y[rows of tile i] = x[rows of tile i] @ w[group_i]`` (``w[group_i]^T`` if ``transpose_w``)."""
    m = x.shape[0]
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))  # contract x_tile with w_e's I (or O)

    def body(i, y):
        lo, own = _tile_rows(tiles, i, m, b)
        x_tile = jax.lax.dynamic_slice_in_dim(x, lo, b, 0)  # [B, I]
        w_e = jax.lax.dynamic_index_in_dim(w, tiles.group[i], 0, keepdims=False)  # [I, O] (or [O, I])
        y_tile = jax.lax.dot_general(x_tile, w_e, dims, precision=precision).astype(y.dtype)  # [B, O]
        # Rows of the window the tile does not own keep what other tiles wrote (or zero).
        old = jax.lax.dynamic_slice_in_dim(y, lo, b, 0)  # [B, O]
        return jax.lax.dynamic_update_slice_in_dim(y, jnp.where(own[:, None], y_tile, old), lo, 0)

    out_dim = w.shape[1] if transpose_w else w.shape[2]
    y = _varying_as(jnp.zeros((m, out_dim), jnp.result_type(x.dtype, w.dtype)), x)  # [M, O]: unwritten rows stay 0
    return jax.lax.fori_loop(0, tiles.count, body, y)


def _tiled_outer(x: jax.Array, dy: jax.Array, num_groups: int, tiles: _Tiles, b: int, precision) -> jax.Array:
    """``dw[e] = x[rows of e]^T @ dy[rows of e]``, accumulated tile by tile in place: ``[E, I, O]``."""
    m = x.shape[0]

    def body(i, dw):
        lo, own = _tile_rows(tiles, i, m, b)
        x_tile = jnp.where(own[:, None], jax.lax.dynamic_slice_in_dim(x, lo, b, 0), 0)  # [B, I]
        dy_tile = jax.lax.dynamic_slice_in_dim(dy, lo, b, 0)  # [B, O]
        d = jax.lax.dot_general(x_tile, dy_tile, (((0,), (0,)), ((), ())), precision=precision)  # [I, O]
        e = tiles.group[i]
        return jax.lax.dynamic_update_index_in_dim(dw, dw[e] + d.astype(dw.dtype), e, 0)

    dw = _varying_as(jnp.zeros((num_groups, x.shape[1], dy.shape[1]), jnp.result_type(x.dtype, dy.dtype)), x)
    return jax.lax.fori_loop(0, tiles.count, body, dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked(x, w, group_sizes, block, precision):
    b = min(block, x.shape[0])
    return _tiled_matmul(x, w, _tiles(group_sizes, x.shape[0], b), b, precision, transpose_w=False)


def _blocked_fwd(x, w, group_sizes, block, precision):
    b = min(block, x.shape[0])
    tiles = _tiles(group_sizes, x.shape[0], b)
    return _tiled_matmul(x, w, tiles, b, precision, transpose_w=False), (x, w, tiles)


def _blocked_bwd(block, precision, res, dy):
    x, w, tiles = res
    b = min(block, x.shape[0])
    dx = _tiled_matmul(dy, w, tiles, b, precision, transpose_w=True)  # [M, I]
    dw = _tiled_outer(x, dy, w.shape[0], tiles, b, precision)  # [E, I, O]
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


# ------------------------------------------------------------------------------------------
# MXFP4 weights: the tile loop, dequantizing one group's weight at a time


def _grouped_quantized(x_sorted: jax.Array, w: QArray, group_sizes: jax.Array, block, precision) -> jax.Array:
    if x_sorted.ndim != 2 or len(w.shape) != 3 or w.axis != 1 or x_sorted.shape[1] != w.shape[1]:
        raise ValueError(
            f"x_sorted [M, I] and MXFP4 w [E, I, O] contracting over I (axis 1) do not match: "
            f"{x_sorted.shape}, {w.shape} axis {w.axis}"
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape [E]=({w.shape[0]},), got {group_sizes.shape}")
    block = default_block(x_sorted.shape[0], w.shape[0]) if block is None else int(block)
    if block < 1:
        raise ValueError(f"block must be a positive number of rows, got {block}")
    if x_sorted.shape[0] == 0:
        return jnp.zeros((0, w.shape[2]), x_sorted.dtype)
    blocks, scales = w.arrays()  # [E, O, I/32, 16], [E, O, I/32]
    x_sorted, blocks, scales, group_sizes = _same_varying(x_sorted, blocks, scales, group_sizes)
    return _blocked_q(x_sorted, blocks, scales, group_sizes.astype(jnp.int32), block, precision)


def _tiled_matmul_q(x, blocks, scales, tiles: _Tiles, b: int, precision, transpose_w: bool) -> jax.Array:
    """``y[rows of tile i] = x[rows of tile i] @ W[group_i]`` (``W^T`` if ``transpose_w``), ``W`` dequantized.

    ``W[e]`` (``[I, O]``) is held as its packed transpose ``[O, I]``; the carry keeps the current
    group's dequantized weight, rebuilt only when the tile's group changes.
    """
    m = x.shape[0]
    O, I = blocks.shape[1], blocks.shape[2] * mxfp4.BLOCK
    dims = (((1,), (0 if transpose_w else 1,)), ((), ()))  # contract x_tile with w_t's I (or O)

    def weight(g):  # [O, I]
        b_g = jax.lax.dynamic_index_in_dim(blocks, g, 0, keepdims=False)
        s_g = jax.lax.dynamic_index_in_dim(scales, g, 0, keepdims=False)
        return mxfp4.dequantize(b_g, s_g, dtype=x.dtype)

    def body(i, carry):
        y, g_cur, w_t = carry
        g = tiles.group[i]
        w_t = jax.lax.cond(g == g_cur, lambda: w_t, lambda: weight(g))
        lo, own = _tile_rows(tiles, i, m, b)
        x_tile = jax.lax.dynamic_slice_in_dim(x, lo, b, 0)  # [B, I] (or [B, O])
        y_tile = jax.lax.dot_general(x_tile, w_t, dims, precision=precision).astype(y.dtype)  # [B, O] (or [B, I])
        old = jax.lax.dynamic_slice_in_dim(y, lo, b, 0)
        return jax.lax.dynamic_update_slice_in_dim(y, jnp.where(own[:, None], y_tile, old), lo, 0), g, w_t

    y = jnp.zeros((m, I if transpose_w else O), x.dtype)  # never-written rows stay 0
    init = tuple(_varying_as(v, x) for v in (y, jnp.int32(-1), jnp.zeros((O, I), x.dtype)))
    return jax.lax.fori_loop(0, tiles.count, body, init)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked_q(x, blocks, scales, group_sizes, block, precision):
    b = min(block, x.shape[0])
    return _tiled_matmul_q(x, blocks, scales, _tiles(group_sizes, x.shape[0], b), b, precision, transpose_w=False)


def _blocked_q_fwd(x, blocks, scales, group_sizes, block, precision):
    b = min(block, x.shape[0])
    tiles = _tiles(group_sizes, x.shape[0], b)
    y = _tiled_matmul_q(x, blocks, scales, tiles, b, precision, transpose_w=False)
    return y, (blocks, scales, tiles)


def _blocked_q_bwd(block, precision, res, dy):
    blocks, scales, tiles = res
    b = min(block, dy.shape[0])
    dx = _tiled_matmul_q(dy, blocks, scales, tiles, b, precision, transpose_w=True)  # [M, I]
    return dx, None, None, None


_blocked_q.defvjp(_blocked_q_fwd, _blocked_q_bwd)
