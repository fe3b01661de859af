"""One step's work, as host arrays, and its broadcast from process 0 to the others.

In a multi-process run (JAX's multi-controller runtime: every process runs the same programs on
its own devices of one global mesh) process 0 owns the scheduler. Each step it broadcasts the
step's :class:`Work` (pool maintenance, the rows' arrays, the sampling inputs); every process then
runs the same jitted programs on them. Shapes vary from step to step (buckets), so a fixed-size
header goes first and says the shapes of what follows. ``jax.experimental.multihost_utils`` does
the transfer; there is no RPC of our own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxmoe.inference.forward import Rows
from jaxmoe.inference.sampler import RowSampling

_MAX_GROUPS = 2
_HEADER = 8 + 3 * _MAX_GROUPS  # flag, 4 maintenance sizes, group count, (B, T, M) per group, embeds D, mask V


class Work(NamedTuple):
    """A step's inputs: maintenance arrays (or None), the groups' rows, their sampling inputs."""

    maintenance: tuple | None
    groups: tuple[Rows, ...]
    sampling: RowSampling | None


def _header(work: Work | None) -> np.ndarray:
    h = np.zeros((_HEADER,), np.int32)
    if work is None:
        return h
    h[0] = 1
    if work.maintenance is not None:
        zero_pages, zero_slots, copy_pages, _, copy_slots, _ = work.maintenance
        h[1:5] = [zero_pages.size, zero_slots.size, copy_pages.size, copy_slots.size]
    h[5] = len(work.groups)
    for g, rows in enumerate(work.groups):
        h[6 + 3 * g : 9 + 3 * g] = [*rows.tokens.shape, rows.pages.shape[1]]
    if work.groups and work.groups[0].embeds is not None:
        h[-2] = work.groups[0].embeds.shape[2]
    if work.sampling is not None and work.sampling.mask is not None:
        h[-1] = work.sampling.mask.shape[1]
    return h


def _placeholder(h: np.ndarray) -> Work:
    """Zero arrays of the shapes the header gives (what non-source processes pass in)."""
    z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)
    maintenance = None
    if h[1]:
        n_zp, n_zs, n_cp, n_cs = (int(x) for x in h[1:5])
        maintenance = (z(n_zp), z(n_zs), z(n_cp), z(n_cp), z(n_cs), z(n_cs))
    groups = []
    for g in range(int(h[5])):
        B, T, M = (int(x) for x in h[6 + 3 * g : 9 + 3 * g])
        images = (z(B, T, int(h[-2]), dtype=np.float32), z(B, T, dtype=bool)) if h[-2] else (None, None)
        groups.append(Rows(z(B, T), z(B), z(B), z(B, M), z(B), *images))
    n = sum(r.tokens.shape[0] for r in groups)
    sampling = None
    if groups:
        f = np.float32
        mask = z(n, int(h[-1]), dtype=bool) if h[-1] else None
        sampling = RowSampling(z(n, dtype=f), z(n, dtype=f), z(n), z(n, dtype=np.uint32), z(n), mask)
    return Work(maintenance, tuple(groups), sampling)


def broadcast(work: Work | None) -> Work | None:
    """Process 0's ``work`` on every process (``None``: the engine is done, followers stop)."""
    if jax.process_count() == 1:
        return work
    source = jax.process_index() == 0
    h = multihost_utils.broadcast_one_to_all(_header(work if source else None))
    if not h[0]:
        return None
    return multihost_utils.broadcast_one_to_all(work if source else _placeholder(h))
