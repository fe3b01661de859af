"""Context parallelism: what every attention kind shares when the sequence is split over ``context``.

The context-parallel paths run inside ``jax.shard_map`` over the whole mesh: the sequence
dimension is split over ``context``, batch dimensions stay split over the axes the ``batch`` rule
names, heads over the axes of ``act_heads``, and the collectives are written out, not left to
the compiler. Callers see global arrays ``x[B_data, T_context, ...]``. One module per attention
kind holds its path:

- MLA, :mod:`jaxmoe.attention.mla_context`: ring attention; the KV latent travels round the ring.
- KDA, :mod:`jaxmoe.attention.kda_context`: the delta rule's boundary states composed after one
  all-gather, and the short conv with a halo from the previous shard.
- DSA, :mod:`jaxmoe.attention.dsa_context`: the streamed sparse attention with the keys going
  round the ring.

Here: the mesh query :func:`context_parallel_size` (a layer takes its context-parallel path when
it is > 1), the ``shard_map`` specs (:func:`token_spec`, :func:`rule_axes`), the length check and
the varying-axes cast the paths share, and the zig-zag layout :func:`to_zigzag` /
:func:`from_zigzag`: with 2P chunks of the sequence, shard ``p`` holds chunks ``p`` and
``2P-1-p``, so under a causal mask every shard has the same amount of visible work (a contiguous
split leaves shard 0 idle while shard P-1 sees everything).

Shape letters: B batch, T sequence length (global; ``_local`` values hold T/P), P shards on
``context``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.rules import RULES, mesh_axes

CONTEXT = "context"


# --------------------------------------------------------------------------------------------
# Mesh queries and specs


def context_parallel_size() -> int:
    """Size of the ``context`` axis of the mesh set with ``jax.set_mesh``; 1 without one.

    Inside a ``shard_map`` that is already manual over ``context`` the sequence is already
    local, so this returns 1 there too.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT not in mesh.axis_names:
        return 1
    if dict(zip(mesh.axis_names, mesh.axis_types))[CONTEXT] == jax.sharding.AxisType.Manual:
        return 1
    return mesh.shape[CONTEXT]


def rule_axes(logical: str, size: int) -> str | tuple[str, ...] | None:
    """Mesh axes of ``RULES[logical]`` that evenly split a dimension of ``size`` (a prefix).

    A dimension the rule's axes do not divide (batch 1 on a data-2 mesh) stays replicated over
    the rest rather than failing inside ``shard_map``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = mesh_axes(dict(RULES)[logical])
    kept, prod = [], 1
    for a in axes:
        if a not in mesh.axis_names or size % (prod * mesh.shape[a]):
            break
        kept.append(a)
        prod *= mesh.shape[a]
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def token_spec(batch: int, rank: int, heads: int | None = None) -> PartitionSpec:
    """``shard_map`` spec of a ``[B, T, ...]`` array with T on ``context``.

    Args:
        batch: the array's batch size B (its axes follow the ``batch`` rule where they divide it).
        rank: the array's rank (>= 2).
        heads: size of dimension 2 if it is a heads dimension (split like ``act_heads``).
    """
    rest = [None] * (rank - 2)
    if heads is not None:
        rest[0] = rule_axes("act_heads", heads)
    return PartitionSpec(rule_axes("batch", batch), CONTEXT, *rest)


def check_length(name: str, length: int, multiple: int, why: str) -> None:
    """Raises ValueError naming ``name`` unless its sequence ``length`` is a multiple of ``multiple``."""
    if length % multiple:
        raise ValueError(
            f"{name} has sequence length {length}, which context parallelism over mesh axis "
            f"'context' (size {context_parallel_size()}) needs to be a multiple of {multiple} ({why})"
        )


def _vma(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (JAX 0.10 names it ``manual_axis_type``)."""
    return jax.typeof(x).manual_axis_type.varying


def varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` cast to vary over every mesh axis ``like`` varies over (scan carries must agree)."""
    missing = tuple(sorted(_vma(like) - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# --------------------------------------------------------------------------------------------
# Zig-zag layout


def _zigzag_shard(chunk: int, p: int) -> int:
    """Shard holding ``chunk`` (of 2P) in the zig-zag layout: p holds chunks p and 2P-1-p."""
    return chunk if chunk < p else 2 * p - 1 - chunk


def _zigzag_local(x_local: jax.Array, p: int, inverse: bool) -> jax.Array:
    """Contiguous <-> zig-zag on one shard's ``[B, T/P, ...]``; two ppermutes of half a shard.

    Contiguous: shard d holds chunks 2d, 2d+1. Zig-zag: slot 0 holds chunk d, slot 1 chunk
    2P-1-d; of those two, the even chunk is in slot 0 exactly when d is even.
    """
    even_perm = [(d, _zigzag_shard(2 * d, p)) for d in range(p)]
    odd_perm = [(d, _zigzag_shard(2 * d + 1, p)) for d in range(p)]
    first, second = jnp.split(x_local, 2, axis=1)
    d_even = jax.lax.axis_index(CONTEXT) % 2 == 0
    if inverse:
        even = jnp.where(d_even, first, second)
        odd = jnp.where(d_even, second, first)
        even = jax.lax.ppermute(even, CONTEXT, [(b, a) for a, b in even_perm])
        odd = jax.lax.ppermute(odd, CONTEXT, [(b, a) for a, b in odd_perm])
        return jnp.concatenate([even, odd], axis=1)
    even = jax.lax.ppermute(first, CONTEXT, even_perm)
    odd = jax.lax.ppermute(second, CONTEXT, odd_perm)
    return jnp.concatenate([jnp.where(d_even, even, odd), jnp.where(d_even, odd, even)], axis=1)


def _zigzag(x: jax.Array, inverse: bool) -> jax.Array:
    p = context_parallel_size()
    if p == 1:
        return x
    check_length("zig-zag input", x.shape[1], 2 * p, "2P chunks, two per shard")
    spec = token_spec(x.shape[0], x.ndim)
    fn = functools.partial(_zigzag_local, p=p, inverse=inverse)
    return jax.shard_map(fn, in_specs=spec, out_specs=spec)(x)


def to_zigzag(x: jax.Array) -> jax.Array:
    """``[B, T, ...]`` in sequence order -> the zig-zag order of :func:`zigzag_order`.

    Identity without a context-parallel mesh. T must be a multiple of 2P.
    """
    return _zigzag(x, inverse=False)


def from_zigzag(x: jax.Array) -> jax.Array:
    """Inverse of :func:`to_zigzag`."""
    return _zigzag(x, inverse=True)


def zigzag_order(length: int, p: int) -> list[int]:
    """The token order of the zig-zag layout: ``to_zigzag(x) == x[:, zigzag_order(T, P)]``."""
    chunk = length // (2 * p)
    chunks = [c for d in range(p) for c in (d, 2 * p - 1 - d)]
    return [c * chunk + i for c in chunks for i in range(chunk)]
