"""The mesh axes and the one table of logical axis rules: plain data, no jax, nothing from jaxmoe.

Parameters and activations are named with logical axes (``'embed'``, ``'heads'``, ``'batch'``, ...);
:data:`RULES` maps each name to the mesh axes that split it (:func:`mesh_axes` reads a rule's value
as a tuple), and :func:`jaxmoe.sharding.logical_to_spec` turns a tuple of names into a
``PartitionSpec``. The configuration checks (:mod:`jaxmoe.config`), the mesh and constraints
(:mod:`jaxmoe.sharding`) and the ``shard_map`` regions (context and expert parallelism) all read the
table from here, so this module is a leaf of the import graph and :mod:`jaxmoe.config` stays free of
jax.

Sharding in prose: ``x[B_data, T_context, D]`` means batch over ``data``, sequence over ``context``.
"""

from __future__ import annotations

from collections.abc import Sequence

# The five mesh axes, major first; an axis of size 1 is simply unused.
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

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
    ("q_latent", None),  # the q latent where it is an output (q_a): embed already takes fsdp
    ("q_lora", "fsdp"),  # the q latent as the input of q_b and the indexer's wq_b
    ("kv_latent", None),  # the KV latent where it is an output (kv_a) or cached
    ("kv_lora", "fsdp"),  # the KV latent as the input of kv_b
    ("ffw", "tensor"),
    ("experts", "expert"),
    ("expert_ffw", "tensor"),
    ("conv", None),
    ("norm", None),
    ("layers", None),
)


def mesh_axes(rule: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes a rule value names, as a tuple: ``None -> ()``, ``'a' -> ('a',)``, ``('a', 'b')`` as is."""
    if rule is None:
        return ()
    if isinstance(rule, str):
        return (rule,)
    return tuple(rule)
