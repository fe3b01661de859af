"""Mesh construction (CPU meshes as ``jax.make_mesh`` lays them out, multi-slice TPU meshes from fake
devices) and the rule table (one mesh axis per dimension; the target's parameter shardings)."""

import dataclasses
import itertools
import math
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import MESH_AXES, MeshConfig
from jaxmoe.sharding import device_grid, logical_to_spec, make_mesh

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


# ------------------------------------------------------------------------------------------
# The rule table: a mesh axis splits one dimension, and the target's parameters as placed


def test_logical_to_spec_raises_on_a_mesh_axis_used_twice():
    rules = (("rows", "fsdp"), ("cols", ("expert", "fsdp")), ("other", "tensor"))
    assert logical_to_spec(("rows", "other"), rules) == PartitionSpec("fsdp", "tensor")
    with pytest.raises(ValueError, match=r"'rows' and 'cols' both map to mesh axis 'fsdp'"):
        logical_to_spec(("rows", "cols"), rules)
    with pytest.raises(KeyError, match="'nope' has no sharding rule"):
        logical_to_spec(("nope",), rules)


# Every parameter of configs/target.py by (layer kind, path) -> its PartitionSpec under RULES.
# Routed experts split over expert x fsdp (x tensor); every matrix with a d_model or latent input
# splits over fsdp; only vectors and the small per-head KDA tensors stay replicated over fsdp.
TARGET_SPECS = {
    "embed": ("tensor", "fsdp"),
    "final_norm.weight": (None,),
    "lm_head": ("fsdp", "tensor"),
    "*.attn_norm.weight": (None,),
    "*.ffn_norm.weight": (None,),
    "dense.ffn.gate": ("fsdp", "tensor"),
    "dense.ffn.up": ("fsdp", "tensor"),
    "dense.ffn.down": ("tensor", "fsdp"),
    "moe.ffn.router": ("fsdp", None),
    "moe.ffn.router_bias": (None,),
    "moe.ffn.shared.gate": ("fsdp", "tensor"),
    "moe.ffn.shared.up": ("fsdp", "tensor"),
    "moe.ffn.shared.down": ("tensor", "fsdp"),
    "moe.ffn.w_gate": ("expert", "fsdp", "tensor"),
    "moe.ffn.w_up": ("expert", "fsdp", "tensor"),
    "moe.ffn.w_down": ("expert", "tensor", "fsdp"),
    "mla.attn.q_a": ("fsdp", None),
    "mla.attn.q_a_norm.weight": (None,),
    "mla.attn.q_b": ("fsdp", "tensor", None),
    "mla.attn.kv_a": ("fsdp", None),
    "mla.attn.kv_a_norm.weight": (None,),
    "mla.attn.kv_b": ("fsdp", "tensor", None),
    "mla.attn.o": ("tensor", None, "fsdp"),
    "dsa.attn.indexer.wq_b": ("fsdp", "tensor", None),
    "dsa.attn.indexer.wk": ("fsdp", None),
    "dsa.attn.indexer.k_norm.weight": (None,),
    "dsa.attn.indexer.k_norm.bias": (None,),
    "dsa.attn.indexer.weights_proj": ("fsdp", "tensor"),
    "kda.attn.q": ("fsdp", "tensor", None),
    "kda.attn.k": ("fsdp", "tensor", None),
    "kda.attn.v": ("fsdp", "tensor", None),
    "kda.attn.q_conv": (None, "tensor", None),
    "kda.attn.k_conv": (None, "tensor", None),
    "kda.attn.v_conv": (None, "tensor", None),
    "kda.attn.f_a": ("fsdp", None),
    "kda.attn.f_b": (None, "tensor", None),
    "kda.attn.dt_bias": ("tensor", None),
    "kda.attn.A_log": ("tensor",),
    "kda.attn.b": ("fsdp", "tensor"),
    "kda.attn.g_a": ("fsdp", None),
    "kda.attn.g_b": (None, "tensor", None),
    "kda.attn.o_norm": (None,),
    "kda.attn.o": ("tensor", None, "fsdp"),
}


def _golden_key(path: tuple, cfg) -> list[str]:
    """The TARGET_SPECS keys a parameter path may match: by attention kind, by FFN kind, or any layer."""
    if path[0] != "layers":
        return [".".join(map(str, path))]
    i, rest = int(path[1]), ".".join(map(str, path[2:]))
    ffn = "dense" if i < cfg.model.moe.first_k_dense else "moe"
    kind = cfg.model.layer_kinds[i]
    # DSA layers are MLA layers plus the indexer.
    kinds = [kind, "mla"] if kind == "dsa" else [kind]
    return [f"{k}.{rest}" for k in (*kinds, ffn)] + [f"*.{rest}"]


def test_target_parameter_shardings_golden():
    from flax import nnx

    from jaxmoe.config import load_config
    from jaxmoe.model import abstract_model
    from jaxmoe.sharding import param_axes

    cfg = load_config(ROOT / "configs" / "target.py")
    sizes = dict(zip(MESH_AXES, cfg.mesh.shape))
    mesh = jax.sharding.AbstractMesh(cfg.mesh.shape, MESH_AXES)
    used, replicated = set(), 0
    for path, v in nnx.to_flat_state(nnx.state(abstract_model(cfg.model))):
        keys = [k for k in _golden_key(path, cfg) if k in TARGET_SPECS]
        assert keys, f"parameter {'.'.join(map(str, path))} has no golden spec"
        used.add(keys[0])
        spec = logical_to_spec(param_axes(v))
        assert spec == PartitionSpec(*TARGET_SPECS[keys[0]]), (path, spec)
        value = v.get_value()
        shard = NamedSharding(mesh, spec).shard_shape(value.shape)
        splits = [math.prod(sizes[a] for a in jax.tree.leaves(s)) for s in spec]
        assert all(n * k == d for n, d, k in zip(shard, value.shape, splits))
        if "fsdp" not in jax.tree.leaves(tuple(spec)):
            replicated += math.prod(value.shape)
    assert used == set(TARGET_SPECS)  # every golden entry is some parameter's
    # 0.006% of the 2.8T parameters stay whole on every fsdp shard: vectors and KDA's [H, N, H] gate maps.
    assert replicated < 0.0001 * 2.797e12
