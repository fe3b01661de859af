"""Mesh construction: CPU meshes as ``jax.make_mesh`` lays them out, multi-slice TPU meshes from fake devices."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from jaxmoe.config import MESH_AXES, MeshConfig
from jaxmoe.sharding import device_grid, make_mesh


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    """The attributes ``mesh_utils`` reads from a TPU device."""

    id: int
    slice_index: int
    coords: tuple[int, int, int]
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"


def fake_slices(n_slices: int, shape: tuple[int, int, int]) -> list[FakeTpu]:
    """``n_slices`` slices, each a torus of chips of ``shape`` with coordinates from 0 (as on real TPUs)."""
    per = int(np.prod(shape))
    out = []
    for s in range(n_slices):
        for k, (z, y, x) in enumerate(itertools.product(*(range(n) for n in shape[::-1]))):
            out.append(FakeTpu(id=s * per + k, slice_index=s, coords=(x, y, z)))
    return out


def test_cpu_mesh_as_jax_make_mesh(mesh):  # conftest's fixture, built by make_mesh
    ref = jax.make_mesh(mesh.devices.shape, MESH_AXES, devices=jax.devices())
    assert mesh.axis_names == MESH_AXES
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in ref.devices.flat]


def test_device_count_mismatch_names_mesh():
    with pytest.raises(ValueError, match=r"needs 4 devices, 8 available"):
        make_mesh(MeshConfig(data=2, tensor=2))


MULTI_SLICE = [
    MeshConfig(data=2, fsdp=2, tensor=2),
    MeshConfig(data=4, fsdp=2),
    MeshConfig(data=2, expert=4),
    MeshConfig(data=8),
    MeshConfig(data=2, context=2, tensor=2),
]


@pytest.mark.parametrize("cfg", MULTI_SLICE, ids=lambda c: "x".join(map(str, c.shape)))
@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_two_slices_split_the_data_axis(cfg, order):
    devices = fake_slices(2, (2, 2, 1))
    if order == "reversed":  # slices are taken by slice_index, not by position in the list
        devices = devices[::-1]
    grid = device_grid(cfg, devices)
    assert grid.shape == cfg.shape
    assert sorted(d.id for d in grid.flat) == list(range(8))
    half = cfg.data // 2
    slices = np.vectorize(lambda d: d.slice_index)(grid)
    # slice 0 holds the first contiguous half of `data`, slice 1 the second; no other axis crosses slices
    assert (slices[:half] == 0).all() and (slices[half:] == 1).all()
    # both slices lay their chips out alike, so every within-slice axis links the same ICI neighbours
    coords = np.vectorize(lambda d: d.coords, otypes=[object])(grid)
    assert (coords[:half] == coords[half:]).all()


def test_slices_within_slice_axes_are_ici_neighbours():
    # 2 slices of a 2x2x1 torus; fsdp=2, tensor=2 within the slice: each step along them moves one chip.
    grid = device_grid(MeshConfig(data=2, fsdp=2, tensor=2), fake_slices(2, (2, 2, 1)))
    for axis in (MESH_AXES.index("fsdp"), MESH_AXES.index("tensor")):
        a, b = np.split(grid, 2, axis=axis)
        for da, db in zip(a.flat, b.flat):
            assert da.slice_index == db.slice_index
            assert sum(abs(p - q) for p, q in zip(da.coords, db.coords)) == 1


@pytest.mark.parametrize(
    "cfg, n_slices, chips",
    [(MeshConfig(fsdp=8), 2, (2, 2, 1)), (MeshConfig(data=2, fsdp=4), 4, (2, 1, 1))],
)
def test_data_not_multiple_of_slices(cfg, n_slices, chips):
    with pytest.raises(
        ValueError, match=rf"mesh.data={cfg.data} must be a multiple of the number of slices \({n_slices}\)"
    ):
        device_grid(cfg, fake_slices(n_slices, chips))


def test_uneven_slices():
    devices = fake_slices(2, (2, 2, 1))
    devices[3] = dataclasses.replace(devices[3], slice_index=1)  # 3 devices in slice 0, 5 in slice 1
    with pytest.raises(ValueError, match=r"unevenly over slices: \{0: 3, 1: 5\}"):
        device_grid(MeshConfig(data=2, fsdp=4), devices)
