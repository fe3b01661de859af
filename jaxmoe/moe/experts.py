"""Routed-expert computation: the dispatch functions behind ``cfg.moe.dispatch``.

Shapes: N tokens, D model dim, E experts, F expert ffw dim, K experts per token,
A = N*K token-expert assignments.

Every dispatch function has the signature of :data:`Dispatch`: given the tokens, the router's
choice, the stacked expert weights and the MoE config, it returns the weighted sum of the chosen
experts' outputs per token and the routing statistics (:class:`MoEStats`). All four live in
:mod:`jaxmoe.moe.expert_parallel` (``jax.shard_map`` regions): ``"dense"`` keeps every expert on
every device and each device's tokens where they are; ``"dropless"``, ``"capacity"`` and
``"ragged"`` split the experts over the ``expert`` axis.

Each runs its experts' rows as groups of a grouped matmul (:func:`jaxmoe.moe.grouped.grouped_matmul`:
``jax.lax.ragged_dot`` on TPU/GPU, a blocked loop on CPU) inside ``shard_map``: under plain GSPMD
the sort by expert would make XLA gather every token onto every device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxmoe.config import MOE_DISPATCH
from jaxmoe.moe.expert_parallel import MoEStats, capacity_experts, dense_experts, dropless_experts, ragged_experts

# (x_flat [N, D], weights [N, K], indices [N, K], w_gate [E, D, F], w_up [E, D, F],
#  w_down [E, F, D], moe: MoEConfig) -> (y_flat [N, D], MoEStats)
Dispatch = Callable[..., tuple[jax.Array, MoEStats]]


_DISPATCH: dict[str, Dispatch] = {
    "dense": dense_experts,
    "dropless": dropless_experts,
    "capacity": capacity_experts,
    "ragged": ragged_experts,
}


def get_dispatch(name: str) -> Dispatch:
    """The routed-expert function for ``cfg.moe.dispatch`` (one of ``MOE_DISPATCH``)."""
    if name not in _DISPATCH:
        raise ValueError(f"model.moe.dispatch={name!r} is not one of {MOE_DISPATCH}")
    return _DISPATCH[name]
