"""Expert parallelism: the routed experts inside ``jax.shard_map``, three dispatch paths.

Shapes: N tokens (all shards), n tokens on one shard, D model dim, E experts, P devices on the
``expert`` axis, L = E / P experts on one device, K experts per token, A = n * K assignments on one
shard, F expert ffw dim (F_local on one ``tensor`` shard), C capacity slots per (shard, expert).

Sharding inside the ``shard_map`` region::

    x[N_(data,fsdp,expert,context), D]     weights, indices [N_(data,fsdp,expert,context), K]
    w_gate, w_up [E_expert, D, F_tensor]   w_down [E_expert, F_tensor, D]

Outside the MoE the ``expert`` axis is one more batch axis (``RULES['batch']``, DeepSeek-style),
so the devices of one expert group hold different tokens; inside, they exchange tokens so that
each assignment runs on the device that holds its expert, and the results travel back to the
token's owner. ``D`` is gathered over ``fsdp`` at the region's entry (the FSDP all-gather; the
gradient's reduce-scatter is its transpose). ``F`` stays split over ``tensor`` (Megatron-style
expert ffw): gate and up give ``[.., F_local]``, down gives partial sums over ``tensor``. Every
step after the down projection (return exchange, weighting, sum over K) is linear, so one
``psum`` over ``tensor`` at the very end, on the ``[n, D]`` result where it is smallest, completes
them. Tokens are replicated over ``tensor``; the expert weights, most of a 2.8T model, stay split.

Paths (``model.moe.dispatch``):

- ``"dense"``: no expert parallelism. Every device holds all experts (gathered over ``expert``
  and ``fsdp`` at entry) and runs ``"dropless"``'s local steps on its own tokens only, so the
  tokens, split over every token axis including ``context``, never move. (Left to GSPMD, the
  sort by expert would gather all ``N`` tokens onto every device.)
- ``"dropless"``: ``all_gather`` the expert group's tokens, sort the assignments that hit local
  experts, grouped matmul (:func:`jaxmoe.moe.grouped.grouped_matmul`), weight, and
  ``psum_scatter`` the sums back to the token owners. Exact; each device sorts ``P * A`` rows.
- ``"capacity"``: every shard packs, for each expert, at most ``C = ceil(capacity_factor * n * K
  / E)`` assignments into a ``[E, C, D]`` buffer (first choices of all tokens before any second
  choice, then token order); ``all_to_all`` sends each expert its rows, a batched matmul runs the
  ``[L, P * C, D]`` slots, a second ``all_to_all`` returns them. Assignments over capacity are
  dropped: they contribute nothing, and are counted in :class:`MoEStats`.
- ``"ragged"``: dropless with ``jax.lax.ragged_all_to_all``: each shard sends each expert exactly
  its rows, at offsets (:func:`ragged_plan`) that land them already grouped by expert on the
  receiver. TPU/GPU only (XLA:CPU does not implement the collective); the receive buffer is sized
  for the worst case, ``P * A`` rows. :func:`emulate_ragged_all_to_all` is a slow reference of the
  collective from CPU collectives, which tests use to run this path on CPU.

Tokens are padded to a multiple of the shard count; padding rows route to no expert.

MXFP4 expert weights (:class:`jaxmoe.quant.QArray`) cross into the region packed: their
``blocks``/``scales`` get the specs of the float weight with the contracting dim moved last, and
:func:`jaxmoe.moe.grouped.grouped_matmul` dequantizes one local expert at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmoe.config import MoEConfig
from jaxmoe.moe.grouped import grouped_matmul
from jaxmoe.quant.qarray import QArray
from jaxmoe.rules import MESH_AXES, RULES, mesh_axes
from jaxmoe.sharding import mesh_platform

_HIGHEST = jax.lax.Precision.HIGHEST


class MoEStats(NamedTuple):
    """Routing statistics of one MoE call (over all tokens of the batch, padding excluded).

    Attributes:
      expert_load: ``[E]`` int32 assignments the router sent to each expert (before any drop).
      dropped: ``[]`` int32 token-expert assignments dropped for capacity (0 on dropless paths).
      drop_fraction: ``[]`` float32 ``dropped / (N * K)``.
    """

    expert_load: jax.Array
    dropped: jax.Array
    drop_fraction: jax.Array


class _Axes(NamedTuple):
    """Mesh axis names inside the region."""

    expert: str | None  # the axis that splits the experts; None: every device holds all (dense)
    tokens: tuple[str, ...]  # the axes that split tokens (expert among them)
    ffw: str | None  # the axis that splits the expert ffw dim, or None


class RaggedPlan(NamedTuple):
    """Arguments of one ``jax.lax.ragged_all_to_all``, from one shard's view: ``[E]`` int32 each.

    Slice ``i`` goes to (or, for ``recv_sizes``, comes from) shard ``i // L``; see the collective's
    documentation for the meaning of each field.
    """

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


# ------------------------------------------------------------------------------------------
# Shared pieces


def _local_ffw(x_sorted, group_sizes, w_gate, w_up, w_down):
    """SwiGLU of rows sorted by local expert: ``[M, D] -> [M, D]`` (partial over ``tensor``)."""
    with jax.named_scope("expert_ffw"):
        gate = grouped_matmul(x_sorted, w_gate, group_sizes, precision=_HIGHEST)  # [M, F_local]
        up = grouped_matmul(x_sorted, w_up, group_sizes, precision=_HIGHEST)  # [M, F_local]
        return grouped_matmul(jax.nn.silu(gate) * up, w_down, group_sizes, precision=_HIGHEST)  # [M, D]


def _combine(out: jax.Array, weights: jax.Array, keep: jax.Array) -> jax.Array:
    """``sum_k keep * weights * out``: ``[n, K, D], [n, K], [n, K] -> [n, D]`` fp32.

    ``where``, not a multiply, so rows never written (or garbage from a kernel) cannot leak NaN.
    """
    with jax.named_scope("expert_combine"):
        out32 = jnp.where(keep[..., None], out, 0).astype(jnp.float32)
        return jnp.einsum("NKD,NK->ND", out32, weights.astype(jnp.float32), precision=_HIGHEST)


def _finish(ax: _Axes, y: jax.Array, dtype, dropped: jax.Array, indices: jax.Array, num_experts: int):
    """Completes the ``tensor`` partial sums and reduces the stats over the token shards."""
    if ax.ffw is not None:
        y = jax.lax.psum(y, ax.ffw)
    valid = indices.reshape(-1)
    load = jnp.bincount(valid, length=num_experts + 1)[:num_experts].astype(jnp.int32)  # padding: id E
    return y.astype(dtype), jax.lax.psum(dropped.astype(jnp.int32), ax.tokens), jax.lax.psum(load, ax.tokens)


def _excl_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


# ------------------------------------------------------------------------------------------
# "dropless": all-gather, local grouped matmul, reduce-scatter


def _dropless_local(ax: _Axes, x, weights, indices, w_gate, w_up, w_down, *, num_experts: int):
    n, K = indices.shape
    L = w_gate.shape[0]
    if ax.expert is None:  # "dense": this device holds every expert, its own tokens are all it runs
        p, x_all, weights_all, indices_all = 0, x, weights, indices
    else:
        p = jax.lax.axis_index(ax.expert)
        with jax.named_scope("ep_all_gather"):
            x_all = jax.lax.all_gather(x, ax.expert, tiled=True)  # [P*n, D]
            weights_all = jax.lax.all_gather(weights, ax.expert, tiled=True)  # [P*n, K]
            indices_all = jax.lax.all_gather(indices, ax.expert, tiled=True)  # [P*n, K]
    with jax.named_scope("expert_sort"):
        local = indices_all - p * L  # [P*n, K]; padding (id E) lands >= L on every shard
        mine = (local >= 0) & (local < L)
        key = jnp.where(mine, local, L).reshape(-1)  # [P*A]: other shards' experts sort last
        order = jnp.argsort(key, stable=True)  # [P*A]
        x_sorted = x_all[order // K]  # [P*A, D]
        group_sizes = jnp.bincount(key, length=L + 1)[:L].astype(jnp.int32)  # [L]
    out_sorted = _local_ffw(x_sorted, group_sizes, w_gate, w_up, w_down)  # [P*A, D]
    out = out_sorted[jnp.argsort(order)].reshape(x_all.shape[0], K, -1)  # [P*n, K, D]
    y_all = _combine(out, weights_all, mine)  # [P*n, D]: this shard's experts' share of every token
    if ax.expert is None:
        y = y_all
    else:
        with jax.named_scope("ep_reduce_scatter"):
            y = jax.lax.psum_scatter(y_all, ax.expert, scatter_dimension=0, tiled=True)  # [n, D]
    return _finish(ax, y, x.dtype, jnp.zeros((), jnp.int32), indices, num_experts)


# ------------------------------------------------------------------------------------------
# "capacity": all_to_all of fixed-size per-expert buffers


def capacity(n: int, moe: MoEConfig) -> int:
    """Slots ``C`` each expert gives each shard of ``n`` tokens: ``ceil(capacity_factor * n * K / E)``.

    At least 1; at most ``n`` (a token chooses an expert at most once, so ``n`` never drops).
    """
    c = math.ceil(moe.capacity_factor * n * moe.experts_per_token / moe.num_experts)
    return max(1, min(n, c))


def _capacity_local(ax: _Axes, x, weights, indices, w_gate, w_up, w_down, *, num_experts: int, C: int):
    n, K = indices.shape
    E, L, D = num_experts, w_gate.shape[0], x.shape[1]
    P = E // L
    with jax.named_scope("capacity_slots"):
        # k-major order: every token's first choice claims a slot before any second choice.
        e_km = indices.T.reshape(K * n)  # [K*n]
        t_km = jnp.tile(jnp.arange(n, dtype=jnp.int32), K)  # [K*n]: the token of each entry
        order = jnp.argsort(e_km, stable=True)
        counts = jnp.bincount(e_km, length=E + 1)  # [E+1]; padding counted at E
        starts = jnp.cumsum(counts) - counts
        rank = jnp.zeros(K * n, jnp.int32).at[order].set(jnp.arange(K * n, dtype=jnp.int32) - starts[e_km[order]])
        valid = e_km < E
        kept = valid & (rank < C)  # [K*n]
        slot = jnp.where(kept, e_km * C + rank, E * C)  # [K*n]; E*C: no slot
        slot_token = jnp.full(E * C, n, jnp.int32).at[slot].set(t_km, mode="drop")  # [E*C]; n: empty
        x_send = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[slot_token]  # [E*C, D]
    with jax.named_scope("ep_all_to_all"):
        x_recv = jax.lax.all_to_all(x_send, ax.expert, 0, 0, tiled=True)  # [P*L*C, D] by source shard
        x_exp = x_recv.reshape(P, L, C, D).transpose(1, 0, 2, 3).reshape(L, P * C, D)  # [L, P*C, D]
    if isinstance(w_gate, QArray) or isinstance(w_up, QArray) or isinstance(w_down, QArray):
        # Packed weights: every expert's P*C slots are one group of the grouped matmul.
        sizes = jnp.full((L,), P * C, jnp.int32)
        out_exp = _local_ffw(x_exp.reshape(L * P * C, D), sizes, w_gate, w_up, w_down).reshape(L, P * C, D)
    else:
        with jax.named_scope("expert_ffw"):
            gate = jnp.einsum("LSD,LDF->LSF", x_exp, w_gate, precision=_HIGHEST)
            up = jnp.einsum("LSD,LDF->LSF", x_exp, w_up, precision=_HIGHEST)
            out_exp = jnp.einsum("LSF,LFD->LSD", jax.nn.silu(gate) * up, w_down, precision=_HIGHEST)  # [L, P*C, D]
    with jax.named_scope("ep_all_to_all_back"):
        out_send = out_exp.reshape(L, P, C, D).transpose(1, 0, 2, 3).reshape(P * L * C, D)
        out_slots = jax.lax.all_to_all(out_send, ax.expert, 0, 0, tiled=True)  # [E*C, D]: own slots
        out = out_slots[jnp.minimum(slot, E * C - 1)].reshape(K, n, D).transpose(1, 0, 2)  # [n, K, D]
    y = _combine(out, weights, kept.reshape(K, n).T)  # [n, D]
    dropped = jnp.sum(valid & ~kept)
    return _finish(ax, y, x.dtype, dropped, indices, num_experts)


# ------------------------------------------------------------------------------------------
# "ragged": dropless ragged_all_to_all


def ragged_plan(counts: jax.Array, shard: jax.Array | int) -> tuple[RaggedPlan, RaggedPlan, jax.Array]:
    """Offsets and sizes of the ragged exchange there and back, for one shard: a pure function.

    Every shard sends its assignments sorted by global expert id; slice ``e`` of the send side is
    the rows for expert ``e`` (``L`` slices per destination shard). On the receiver, the rows of
    local expert ``l`` from all sources are contiguous (sources in order), groups in expert order,
    so the receive buffer is ready for a grouped matmul. The return exchange is the same plan for
    the transposed traffic: slice ``s * L + l`` sends source ``s``'s rows of local expert ``l`` back
    to where ``s`` sent them from.

    Args:
      counts: ``[P, E]`` int: ``counts[s, e]`` assignments shard ``s`` routes to expert ``e``; the
        same matrix on every shard (an ``all_gather`` of each shard's row).
      shard: this shard's index ``p`` on the ``expert`` axis.

    Returns:
      ``(forward, back, group_sizes)``: the two :class:`RaggedPlan` and ``[L]`` int32 rows per
      local expert in the receive buffer.
    """
    counts = jnp.asarray(counts, jnp.int32)
    P, E = counts.shape
    L = E // P
    mine = jax.lax.dynamic_slice_in_dim(counts, shard * L, L, axis=1)  # [P, L]: sent to my experts
    group_start = _excl_cumsum(counts.sum(0).reshape(P, L), 1).reshape(E)  # [E]: in the owner's buffer
    before = _excl_cumsum(counts, 0)  # [P, E]: rows of expert e from sources before s
    row_start = _excl_cumsum(counts, 1)  # [P, E]: where expert e's rows start in source s's operand
    forward = RaggedPlan(
        input_offsets=row_start[shard],
        send_sizes=counts[shard],
        output_offsets=group_start + before[shard],
        recv_sizes=mine.reshape(P * L),
    )
    my_group_start = jax.lax.dynamic_slice_in_dim(group_start, shard * L, L)  # [L]
    back = RaggedPlan(
        input_offsets=(my_group_start[None, :] + jax.lax.dynamic_slice_in_dim(before, shard * L, L, 1)).reshape(-1),
        send_sizes=mine.reshape(P * L),
        output_offsets=jax.lax.dynamic_slice_in_dim(row_start, shard * L, L, 1).reshape(P * L),
        recv_sizes=counts[shard],
    )
    return forward, back, mine.sum(0)


def _xla_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    if mesh_platform() == "cpu":
        raise NotImplementedError(
            "model.moe.dispatch='ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU does not implement; "
            "on CPU use model.moe.dispatch='dropless' (same result) or 'capacity'"
        )
    return jax.lax.ragged_all_to_all(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
    )


def emulate_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """Slow reference of ``jax.lax.ragged_all_to_all`` from ``all_gather`` and ``all_to_all``.

    Follows the collective's documented semantics literally: receiver-side offsets come from an
    ``all_to_all`` of the senders' ``output_offsets``, and ``recv_sizes`` rows are written per
    slice. Differentiable (gathers and selects), works on XLA:CPU; memory ``O(P * M * D)``, tests
    only. ``send_sizes`` is accepted for the same signature; the plan tests check it against
    ``recv_sizes``.
    """
    del send_sizes
    P = jax.lax.axis_size(axis_name)
    S = input_offsets.shape[0]  # slices; S // P per shard
    M = operand.shape[0]
    operand_all = jax.lax.all_gather(operand, axis_name)  # [P, M, ...]
    src_start = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)  # [S]: in the sender's operand
    dst_start = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [S]: in my output
    src = jnp.arange(S) // (S // P)  # [S]: the sender of received slice i
    rows = jnp.arange(output.shape[0])  # [R]
    hit = (rows[None, :] >= dst_start[:, None]) & (rows[None, :] < (dst_start + recv_sizes)[:, None])  # [S, R]
    flat = src[:, None] * M + src_start[:, None] + rows[None, :] - dst_start[:, None]  # [S, R]
    take = jnp.sum(jnp.where(hit, flat, 0), axis=0)  # [R]
    received = operand_all.reshape(P * M, *operand.shape[1:])[jnp.clip(take, 0, P * M - 1)]  # [R, ...]
    written = jnp.any(hit, axis=0).reshape(-1, *(1,) * (output.ndim - 1))
    return jnp.where(written, received, output)


def _ragged_local(ax: _Axes, x, weights, indices, w_gate, w_up, w_down, *, num_experts: int, exchange: Callable):
    n, K = indices.shape
    E, D = num_experts, x.shape[1]
    P = E // w_gate.shape[0]
    A = n * K
    with jax.named_scope("expert_sort"):
        flat = indices.reshape(A)  # [A]; padding is E and sorts last, never sent
        order = jnp.argsort(flat, stable=True)
        x_sorted = x[order // K]  # [A, D]
        counts = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)  # [E]
        counts_all = jax.lax.all_gather(counts, ax.expert)  # [P, E]
        forward, back, group_sizes = ragged_plan(counts_all, jax.lax.axis_index(ax.expert))
    with jax.named_scope("ep_ragged_all_to_all"):
        # Worst case: every shard's every assignment goes to this shard's experts.
        x_recv = exchange(x_sorted, jnp.zeros((P * A, D), x.dtype), *forward, axis_name=ax.expert)  # [P*A, D]
    out_recv = _local_ffw(x_recv, group_sizes, w_gate, w_up, w_down)  # [P*A, D]; rows past the groups: 0
    with jax.named_scope("ep_ragged_all_to_all_back"):
        out_sorted = exchange(out_recv, jnp.zeros((A, D), out_recv.dtype), *back, axis_name=ax.expert)  # [A, D]
        out = out_sorted[jnp.argsort(order)].reshape(n, K, D)
    y = _combine(out, weights, indices < E)
    return _finish(ax, y, x.dtype, jnp.zeros((), jnp.int32), indices, num_experts)


# ------------------------------------------------------------------------------------------
# The shard_map region


def _region_axes(split_experts: bool = True) -> tuple[jax.sharding.AbstractMesh | jax.sharding.Mesh, _Axes]:
    """The mesh to run on (a one-device mesh when none is set) and the axis roles from ``RULES``.

    ``split_experts=False`` (the ``"dense"`` dispatch): experts are not split, ``_Axes.expert`` is None.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
        mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, axis_types=auto, devices=jax.devices()[:1])
    missing = set(MESH_AXES) - set(mesh.axis_names)
    if missing:
        raise ValueError(
            f"expert-parallel dispatch needs a mesh with axes {MESH_AXES} (jaxmoe.sharding.make_mesh); "
            f"the current mesh has {mesh.axis_names}"
        )
    rules = dict(RULES)
    if mesh_axes(rules["experts"]) != ("expert",):
        raise ValueError(f"expert-parallel dispatch needs RULES['experts'] == 'expert', got {rules['experts']!r}")
    tokens = [a for name in ("batch", "seq") for a in mesh_axes(rules[name])]
    if "expert" not in tokens:
        tokens.append("expert")
    ffw = mesh_axes(rules["expert_ffw"])
    if len(ffw) > 1 or set(ffw) & set(tokens):
        raise ValueError(f"RULES['expert_ffw']={rules['expert_ffw']!r} must be one axis that does not split tokens")
    return mesh, _Axes("expert" if split_experts else None, tuple(dict.fromkeys(tokens)), ffw[0] if ffw else None)


def _weight_in(w, spec: tuple, dtype):
    """``(value, in_spec, rebuild)`` for one expert weight crossing into the region.

    A float weight (array or variable) is cast to the compute dtype. A :class:`QArray` crosses as
    its packed ``(blocks, scales)``, specs following the contracting dim to the end, and
    ``rebuild`` makes the shard-local QArray from the local parts.
    """
    if isinstance(w, QArray):
        blocks, scales = w.arrays()
        a = w.axis
        moved = (*spec[:a], *spec[a + 1 :], spec[a])  # the contracting dim last, blocks of 32 along it

        def rebuild(part, axis=a):
            b, sc = part  # b: [*rest_local, C_local/32, 16]
            rest = b.shape[:-2]
            return QArray(b, sc, (*rest[:axis], b.shape[-2] * 32, *rest[axis:]), axis)

        return (blocks, scales), (PartitionSpec(*moved, None), PartitionSpec(*moved)), rebuild
    w = w[...] if isinstance(w, nnx.Variable) else w
    return w.astype(dtype), PartitionSpec(*spec), lambda v: v


def _expert_parallel(local_fn, x_flat, weights, indices, w_gate, w_up, w_down, moe: MoEConfig, split_experts=True):
    """Pads the tokens, runs ``local_fn`` on every shard, unpads; returns ``(y [N, D], MoEStats)``."""
    mesh, ax = _region_axes(split_experts)
    N, K = indices.shape
    E = moe.num_experts
    P = mesh.shape[ax.expert] if split_experts else 1
    if E % P:
        raise ValueError(f"model.moe.num_experts={E} is not divisible by the mesh's expert axis ({P})")
    F = w_gate.shape[2]
    if ax.ffw is not None and F % mesh.shape[ax.ffw]:
        raise ValueError(f"model.moe.expert_ffw_dim={F} is not divisible by the mesh's {ax.ffw} axis")
    shards = math.prod(mesh.shape[a] for a in ax.tokens)
    pad = -N % shards
    if pad:  # padding tokens route to the nonexistent expert E: no slot, no work, no stats
        x_flat = jnp.pad(x_flat, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        indices = jnp.pad(indices, ((0, pad), (0, 0)), constant_values=E)
    # Inside the region: experts split over `expert` (or whole), the ffw dim over `ffw`, D whole.
    w_in, w_out = (ax.expert, None, ax.ffw), (ax.expert, ax.ffw, None)
    parts, specs, rebuilds = zip(
        *(_weight_in(w, spec, x_flat.dtype) for w, spec in ((w_gate, w_in), (w_up, w_in), (w_down, w_out)))
    )

    def body(x, weights, indices, parts):
        w_gate, w_up, w_down = (rebuild(part) for rebuild, part in zip(rebuilds, parts, strict=True))
        return local_fn(ax, x, weights, indices, w_gate, w_up, w_down)

    tok = PartitionSpec(ax.tokens)
    region = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, tok, tok, specs),
        out_specs=(tok, PartitionSpec(), PartitionSpec()),
    )
    y, dropped, load = region(x_flat, weights, indices, parts)
    return y[:N], MoEStats(load, dropped, dropped.astype(jnp.float32) / (N * K))


def dense_experts(x_flat, weights, indices, w_gate, w_up, w_down, moe: MoEConfig):
    """``dispatch == "dense"``: every device runs its own tokens through all the experts.

    The experts are gathered (over ``expert`` and ``fsdp``; the ffw dim stays split over
    ``tensor``), so nothing about the tokens is exchanged: this is ``"dropless"`` without its
    all-gather and reduce-scatter. Under plain GSPMD the sort by expert would instead gather
    every token onto every device. Args and returns as :func:`dropless_experts`.
    """
    return _expert_parallel(
        functools.partial(_dropless_local, num_experts=moe.num_experts),
        x_flat, weights, indices, w_gate, w_up, w_down, moe, split_experts=False,
    )  # fmt: skip


def dropless_experts(x_flat, weights, indices, w_gate, w_up, w_down, moe: MoEConfig):
    """``dispatch == "dropless"``: all-gather, local grouped matmul, reduce-scatter.

    Args:
      x_flat: ``[N, D]`` tokens in the compute dtype.
      weights: ``[N, K]`` fp32 combine weights.
      indices: ``[N, K]`` int32 chosen experts.
      w_gate, w_up: ``[E, D, F]``; w_down: ``[E, F, D]`` (arrays or ``nnx.Variable``).
      moe: the MoE config.

    Returns:
      ``(y [N, D] in x_flat.dtype, MoEStats)``; ``y`` is what :func:`jaxmoe.moe.reference_experts`
      returns.
    """
    return _expert_parallel(
        functools.partial(_dropless_local, num_experts=moe.num_experts),
        x_flat, weights, indices, w_gate, w_up, w_down, moe,
    )  # fmt: skip


def capacity_experts(x_flat, weights, indices, w_gate, w_up, w_down, moe: MoEConfig):
    """``dispatch == "capacity"``: fixed-capacity ``all_to_all``; drops counted. Args as :func:`dropless_experts`."""
    mesh, ax = _region_axes()
    N = x_flat.shape[0]
    shards = math.prod(mesh.shape[a] for a in ax.tokens)
    C = capacity(-(-N // shards), moe)
    return _expert_parallel(
        functools.partial(_capacity_local, num_experts=moe.num_experts, C=C),
        x_flat, weights, indices, w_gate, w_up, w_down, moe,
    )  # fmt: skip


def ragged_experts(x_flat, weights, indices, w_gate, w_up, w_down, moe: MoEConfig, *, exchange=None):
    """``dispatch == "ragged"``: dropless ``ragged_all_to_all`` (TPU/GPU). Args as :func:`dropless_experts`.

    ``exchange`` replaces ``jax.lax.ragged_all_to_all`` (same signature), e.g. with
    :func:`emulate_ragged_all_to_all` to run this path on CPU. Without it, raises
    ``NotImplementedError`` on XLA:CPU.
    """
    exchange = _xla_ragged_all_to_all if exchange is None else exchange
    return _expert_parallel(
        functools.partial(_ragged_local, num_experts=moe.num_experts, exchange=exchange),
        x_flat, weights, indices, w_gate, w_up, w_down, moe,
    )  # fmt: skip
