"""TPU slices by name, without jax: chip kinds, Cloud TPU accelerator types, and the mesh check.

``jaxmoe compile --mesh-only`` and the launchers (before they create a slice) use this module;
:mod:`jaxmoe.aot` compiles for the slice.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxmoe.config import Config
from jaxmoe.rules import MESH_AXES


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip kind: its HBM and its bf16 matmul peak (Cloud TPU's published figures)."""

    hbm_bytes: int
    peak_bf16_flops: float


# Topology prefix (as ``get_topology_desc`` names it) -> chip. v5p's HBM is 95 GB; v4's, v6e's 32 GiB; v5e's 16 GiB.
CHIPS = {
    "v4": Chip(hbm_bytes=32 * 2**30, peak_bf16_flops=275e12),
    "v5e": Chip(hbm_bytes=16 * 2**30, peak_bf16_flops=197e12),
    "v5p": Chip(hbm_bytes=95 * 10**9, peak_bf16_flops=459e12),
    "v6e": Chip(hbm_bytes=32 * 2**30, peak_bf16_flops=918e12),
}


class TopologyError(ValueError):
    """The topology is unknown, libtpu is missing, or the config's mesh does not map onto the slice."""


def chip_kind(topology: str) -> str:
    """``'v5p:8x16x16' -> 'v5p'``; raises :class:`TopologyError` for a kind not in :data:`CHIPS`."""
    kind, sep, dims = topology.partition(":")
    if not sep or kind not in CHIPS or not dims or not all(d.isdigit() for d in dims.split("x")):
        raise TopologyError(
            f"--topology {topology!r}: expected KIND:AxBxC with KIND one of {sorted(CHIPS)}, "
            "e.g. v5p:4x4x4 or v6e:16x16"
        )
    return kind


# gcloud's accelerator-type prefix -> chip kind, and how many of the type's number one chip counts
# for: v4 and v5p count TensorCores (two a chip), v5e ("v5litepod") and v6e count chips.
ACCELERATOR_TYPES = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5litepod": ("v5e", 1), "v6e": ("v6e", 1)}


def accelerator_topology(accelerator_type: str) -> str:
    """The topology Cloud TPU gives ``accelerator_type`` by default: ``'v5p-128' -> 'v5p:4x4x4'``.

    v4 and v5p slices are 3-D tori, v5e and v6e 2-D; the default shape of a power-of-two slice
    starts from 2x2x1 (2x2), and each doubling doubles the last of the smallest axes: v5p-16
    2x2x2, -32 2x2x4, -64 2x4x4, -128 4x4x4, -2048 8x8x16, -4096 8x16x16; v6e-8 2x4, -256 16x16.
    A slice of any other size is created with an explicit topology: name it (``--topology``).
    """
    prefix, sep, number = accelerator_type.rpartition("-")
    if not sep or prefix not in ACCELERATOR_TYPES or not number.isdigit():
        raise TopologyError(
            f"--accelerator-type {accelerator_type!r}: expected TYPE-N with TYPE one of {sorted(ACCELERATOR_TYPES)}, "
            "e.g. v5p-128, v6e-256, v5litepod-16, v4-32"
        )
    kind, per_chip = ACCELERATOR_TYPES[prefix]
    chips, rest = divmod(int(number), per_chip)
    three_d = kind in ("v4", "v5p")
    if chips == 1 and not three_d:
        return f"{kind}:1x1"
    if rest or chips < 4 or chips & (chips - 1):
        raise TopologyError(
            f"--accelerator-type {accelerator_type!r} ({chips if not rest else number} chips) has no default "
            "topology here: name the slice's shape with --topology KIND:AxBxC"
        )
    if chips == 4:
        return f"{kind}:2x2x1" if three_d else f"{kind}:2x2"
    dims = [2, 2, 2] if three_d else [2, 2]
    while math.prod(dims) < chips:
        smallest = min(dims)
        last = max(i for i, d in enumerate(dims) if d == smallest)
        dims[last] *= 2
    return f"{kind}:" + "x".join(map(str, dims))


def topology_chips(topology: str) -> int:
    """Chips in one slice of ``topology``: ``'v5p:8x16x16' -> 2048``."""
    chip_kind(topology)
    return math.prod(int(d) for d in topology.partition(":")[2].split("x"))


def check_mesh(cfg: Config, topology: str, slices: int = 1) -> dict[str, Any]:
    """That the config's mesh has one device per chip of ``slices`` x ``topology``; no libtpu needed.

    Returns ``{"topology", "slices", "chips", "mesh"}`` (chips of all slices) or raises a
    :class:`TopologyError` naming the mesh and the slice. Every TPU kind here has one JAX device a
    chip (v4's and v5p's two TensorCores form one megacore device).
    """
    if slices < 1:
        raise TopologyError(f"--slices must be >= 1, got {slices}")
    chips = slices * topology_chips(topology)
    sizes = dict(zip(MESH_AXES, cfg.mesh.shape))
    if cfg.mesh.num_devices != chips:
        where = f"topology {topology}" if slices == 1 else f"{slices} slices of topology {topology}"
        raise TopologyError(
            f"mesh {sizes} has {cfg.mesh.num_devices} devices; {where} {'has' if slices == 1 else 'have'} {chips} "
            "(set --config.mesh.AXIS=N so the product of the five axes matches)"
        )
    return {"topology": topology, "slices": slices, "chips": chips, "mesh": sizes}
