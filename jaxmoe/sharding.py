"""The mesh, and the few functions that apply the logical axis rules of :mod:`jaxmoe.rules`.

Parameters are created with logical axis names (``nnx.Param(..., axes=('embed', 'heads', ...))``);
:func:`logical_to_spec` maps those names to mesh axes through :data:`RULES` (the table lives in
:mod:`jaxmoe.rules`, a leaf module, and is re-exported here). Activations are constrained at block
boundaries with :func:`constrain`. The mesh has five axes, ``data, fsdp, expert, context, tensor``;
an axis of size 1 is simply unused.

Sharding in prose: ``x[B_data, T_context, D]`` means batch over ``data``, sequence over ``context``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import MeshConfig
from jaxmoe.rules import MESH_AXES, RULES, mesh_axes


def logical_to_spec(axes: Sequence[str | None], rules=RULES) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec through ``rules``.

    A mesh axis splits at most one dimension of an array. Two names whose rules share a mesh axis
    cannot both be used on one array: that is an error in the array's names or in the rules, and
    dropping the axis from one dimension would replicate that dimension silently.

    Raises:
      KeyError: a name (other than None) has no rule.
      ValueError: two dimensions' rules use the same mesh axis.
    """
    table = dict(rules)
    out, used = [], {}
    for name in axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
        axes_of_dim = mesh_axes(table[name])
        for a in axes_of_dim:
            if a in used:
                raise ValueError(
                    f"logical axes {tuple(axes)}: {used[a]!r} and {name!r} both map to mesh axis {a!r} "
                    "(a mesh axis splits at most one dimension); give one of them another logical name"
                )
            used[a] = name
        out.append(None if not axes_of_dim else axes_of_dim[0] if len(axes_of_dim) == 1 else axes_of_dim)
    return PartitionSpec(*out)


def mesh_platform() -> str:
    """The platform the code being traced will run on: the current mesh's devices', else JAX's default.

    Under an ahead-of-time compile for a TPU topology on a CPU host, ``jax.default_backend()`` is
    ``'cpu'`` while the mesh's devices are TPU chips; choices between platform-specific ops must
    follow the mesh.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


# TPU kinds whose slices need a physical torus axis split between mesh axes (as jax.make_mesh does).
_SPLIT_PHYSICAL_AXES_KINDS = ("TPU v5 lite", "TPU v5e")


def device_grid(mesh_cfg: MeshConfig, devices: Sequence[Any]) -> np.ndarray:
    """Lays ``devices`` out as an array of shape ``mesh_cfg.shape`` (axes :data:`MESH_AXES`).

    Devices of one slice (or with no ``slice_index``, as on CPU and GPU) are placed as
    ``jax.make_mesh`` places them. Devices from several TPU slices form a hybrid mesh: the slices
    split the ``data`` axis, slice-major (the devices of slice ``i`` hold the ``i``-th contiguous
    block of ``data``), so only the data-parallel gradient reduction crosses the data-center
    network; every other axis stays within a slice's ICI torus.

    Args:
      mesh_cfg: the five axis sizes; their product must equal ``len(devices)``.
      devices: objects with ``platform`` and ``device_kind``; on TPU also ``coords``,
        ``core_on_chip`` and ``slice_index``.

    Returns:
      An object array of devices, shape ``mesh_cfg.shape``.
    """
    sizes = dict(zip(MESH_AXES, mesh_cfg.shape))
    if mesh_cfg.num_devices != len(devices):
        raise ValueError(f"mesh {sizes} needs {mesh_cfg.num_devices} devices, {len(devices)} available")
    allow_split = devices[0].device_kind in _SPLIT_PHYSICAL_AXES_KINDS
    per_slice: dict[int, int] = {}
    for d in devices:
        i = getattr(d, "slice_index", 0)
        per_slice[i] = per_slice.get(i, 0) + 1
    n_slices = len(per_slice)
    if n_slices == 1:
        return mesh_utils.create_device_mesh(mesh_cfg.shape, devices, allow_split_physical_axes=allow_split)
    if mesh_cfg.data % n_slices:
        raise ValueError(
            f"mesh.data={mesh_cfg.data} must be a multiple of the number of slices ({n_slices}): "
            f"the data axis spans the slices; mesh {sizes}"
        )
    if len(set(per_slice.values())) != 1:
        raise ValueError(f"devices are spread unevenly over slices: {dict(sorted(per_slice.items()))} per slice")
    dcn = (n_slices,) + (1,) * (len(MESH_AXES) - 1)  # between slices: data only
    ici = (mesh_cfg.data // n_slices, *mesh_cfg.shape[1:])  # within a slice: everything else
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=allow_split)


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """Builds the five-axis mesh (Explicit-free: all axes Auto, so GSPMD propagates).

    Works across TPU slices too: see :func:`device_grid` for the device layout.
    """
    devices = jax.devices() if devices is None else devices
    return jax.sharding.Mesh(
        device_grid(mesh_cfg, devices),
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
    )


def param_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    axes = variable.get_metadata().get("axes")
    if axes is None:
        return (None,) * np.ndim(variable.get_value())
    return tuple(axes)


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
    """NamedSharding for every variable of ``state`` from its ``axes`` metadata."""

    def one(v):
        if isinstance(v, nnx.Variable):
            return v.replace(NamedSharding(mesh, logical_to_spec(param_axes(v))))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def token_axes(rules=RULES) -> tuple[str, ...]:
    """The mesh axes that split a flattened token dimension ``N = B*T``, major first.

    ``x[B, T, D].reshape(B * T, D)`` keeps each device's rows together when B is split over the
    ``batch`` rule's axes and T over the ``seq`` rule's: ``x_flat[N_(batch axes, seq axes), D]``.
    """
    table = dict(rules)
    return tuple(dict.fromkeys(a for name in ("batch", "seq") for a in mesh_axes(table[name])))


def token_parallel(fn: Callable[..., Any], token_args: Sequence[jax.Array], shared_args: Sequence[Any] = ()) -> Any:
    """``fn(*token_args, *shared_args)`` run separately on each device's share of the tokens.

    For work that is independent per token but that GSPMD does not split along the token
    dimension: XLA all-gathers the operand of ``top_k`` (and of a sort or a gather along the
    tokens), so a router under plain ``jit`` on a mesh builds its ``[N, E]`` arrays whole on
    every device, whatever the ``context`` or ``data`` split. Inside ``jax.shard_map`` each
    device sees only its ``N / P`` tokens (P = product of the :func:`token_axes` in the mesh).

    Args:
      fn: maps token arrays (leading dim ``n``) and the shared arguments to a pytree of arrays
        with leading dim ``n``, row ``i`` depending only on row ``i`` of the token arrays.
      token_args: arrays ``[N, ...]``; split over the token axes (zero rows pad N to a multiple
        of P and are cut from the outputs).
      shared_args: pytrees of arrays every device sees whole (gathered if sharded).

    Returns:
      ``fn``'s outputs, leading dim N split over the token axes; ``fn(*token_args, *shared_args)``
      itself when no mesh is set or no token axis of the mesh has size > 1.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    types = dict(zip(mesh.axis_names, mesh.axis_types)) if not mesh.empty else {}
    auto = {a for a, t in types.items() if t != manual}  # inside another shard_map: the axes left
    axes = tuple(a for a in token_axes() if a in auto and mesh.shape[a] > 1)
    if not axes:
        return fn(*token_args, *shared_args)
    N = token_args[0].shape[0]
    pad = -N % math.prod(mesh.shape[a] for a in axes)
    padded = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a for a in token_args]
    tok = PartitionSpec(axes)
    out = jax.shard_map(
        fn,
        in_specs=(*(tok,) * len(padded), *(PartitionSpec(),) * len(shared_args)),
        out_specs=tok,
        axis_names=auto,
    )(*padded, *shared_args)
    return jax.tree.map(lambda y: y[:N], out) if pad else out


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Constrains an activation to its logical sharding when a mesh is set; no-op otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))
