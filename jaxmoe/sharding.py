"""One table of logical axis rules, and the few functions that apply it.

Parameters are created with logical axis names (``nnx.Param(..., axes=('embed', 'heads', ...))``);
:func:`logical_to_spec` maps those names to mesh axes through :data:`RULES`. Activations are
constrained at block boundaries with :func:`constrain`. The mesh has five axes,
``data, fsdp, expert, context, tensor``; an axis of size 1 is simply unused.

Sharding in prose: ``x[B_data, T_context, D]`` means batch over ``data``, sequence over ``context``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import MESH_AXES, MeshConfig

# Logical name -> mesh axis (or tuple of axes, or None for replicated).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    # The expert axis is extra data parallelism outside the MoE (DeepSeek-style): tokens split over it
    # enter the expert-parallel dispatch already spread over the devices that hold different experts.
    ("batch", ("data", "fsdp", "expert")),
    ("seq", "context"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    # parameters
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("q_latent", None),
    ("kv_latent", None),
    ("ffw", "tensor"),
    ("experts", "expert"),
    ("expert_ffw", "tensor"),
    ("conv", None),
    ("norm", None),
    ("layers", None),
)


def logical_to_spec(axes: Sequence[str | None], rules=RULES) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec, refusing a mesh axis used twice."""
    table = dict(rules)
    out, used = [], set()
    for name in axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
        mesh_axes = table[name]
        if mesh_axes is None:
            out.append(None)
            continue
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        clash = used & set(mesh_axes)
        if clash:
            # The first dimension keeps the axis; a later one stays replicated over it.
            mesh_axes = tuple(a for a in mesh_axes if a not in clash)
        used |= set(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*out)


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """Builds the five-axis mesh (Explicit-free: all axes Auto, so GSPMD propagates)."""
    devices = jax.devices() if devices is None else devices
    if mesh_cfg.num_devices != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, mesh_cfg.shape))} needs {mesh_cfg.num_devices} devices, "
            f"{len(devices)} available"
        )
    return jax.make_mesh(
        mesh_cfg.shape,
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
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


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Constrains an activation to its logical sharding when a mesh is set; no-op otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))
