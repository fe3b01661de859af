"""DeepSeek-style MoE FFN: router, routed experts (dispatch paths), shared experts, dense MLP."""

from jaxmoe.moe.expert_parallel import (
    MoEStats,
    RaggedPlan,
    capacity_experts,
    dense_experts,
    dropless_experts,
    emulate_ragged_all_to_all,
    ragged_experts,
    ragged_plan,
)
from jaxmoe.moe.grouped import grouped_matmul
from jaxmoe.moe.layer import MLP, MoE
from jaxmoe.moe.reference import reference_experts, reference_moe
from jaxmoe.moe.router import RouterBias, route

__all__ = [
    "MLP",
    "MoE",
    "MoEStats",
    "RaggedPlan",
    "RouterBias",
    "capacity_experts",
    "dense_experts",
    "dropless_experts",
    "emulate_ragged_all_to_all",
    "grouped_matmul",
    "reference_experts",
    "ragged_experts",
    "ragged_plan",
    "reference_moe",
    "route",
]
