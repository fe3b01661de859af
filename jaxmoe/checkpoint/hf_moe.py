"""HF (DeepSeek-V3 / Kimi Linear) FFN tensors -> :class:`jaxmoe.moe.MLP` and :class:`jaxmoe.moe.MoE`.

On-disk layout (what ``save_pretrained`` writes), torch ``[out, in]`` weights, for a prefix
such as ``model.layers.3.mlp.``::

    {prefix}gate_proj.weight [F, D]  up_proj.weight [F, D]  down_proj.weight [D, F]   (dense MLP)
    {prefix}gate.weight [E, D]   {prefix}gate.e_score_correction_bias [E]              (router)
    {prefix}experts.{e}.gate_proj.weight [F, D]  .up_proj.weight [F, D]  .down_proj.weight [D, F]
    {prefix}shared_experts.gate_proj.weight ...                                         (an MLP)

transformers fuses experts in memory (``experts.gate_up_proj [E, 2F, D]``) but saves them per
expert; only the saved layout is read here. Kimi Linear's saved layout names the block
``block_sparse_moe.`` and its routed experts ``w1`` (gate), ``w3`` (up), ``w2`` (down):
pass ``expert_names=KIMI_EXPERT_NAMES``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxmoe.checkpoint.hf_common import assign, take
from jaxmoe.errors import CheckpointError
from jaxmoe.moe import MLP, MoE


def load_mlp(module: MLP, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
    """Reads ``{prefix}{gate,up,down}_proj.weight`` into ``module`` (transposed to ``[in, out]``)."""
    for name, variable in (("gate_proj", module.gate), ("up_proj", module.up), ("down_proj", module.down)):
        key = f"{prefix}{name}.weight"
        assign(variable, take(tensors, key).T, key)


def _stack_experts(tensors: Mapping[str, np.ndarray], prefix: str, name: str, num_experts: int) -> np.ndarray:
    """``experts.{e}.{name}.weight`` ``[out, in]`` for every e -> ``[E, in, out]``."""
    return np.stack([take(tensors, f"{prefix}experts.{e}.{name}.weight").T for e in range(num_experts)])


DEEPSEEK_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
KIMI_EXPERT_NAMES = ("w1", "w3", "w2")


def load_moe(
    module: MoE,
    tensors: Mapping[str, np.ndarray],
    prefix: str,
    expert_names: tuple[str, str, str] = DEEPSEEK_EXPERT_NAMES,
) -> None:
    """Reads a DeepSeek-style MoE block (router, bias, routed and shared experts) into ``module``.

    ``expert_names`` are the saved names of each routed expert's gate, up and down projections.
    """
    E = module.moe.num_experts
    if f"{prefix}experts.gate_up_proj" in tensors:
        raise CheckpointError(
            f"found fused {prefix!r}experts.gate_up_proj (transformers' in-memory layout); "
            f"expected per-expert tensors {prefix!r}experts.<e>.gate_proj.weight as saved on disk"
        )
    if f"{prefix}experts.{E}.{expert_names[0]}.weight" in tensors:
        raise CheckpointError(
            f"checkpoint has tensor {prefix}experts.{E}.{expert_names[0]}.weight, more routed experts than "
            f"model.moe.num_experts={E}"
        )

    key = f"{prefix}gate.weight"
    assign(module.router, take(tensors, key).T, key)  # [E, D] -> [D, E]
    key = f"{prefix}gate.e_score_correction_bias"
    assign(module.router_bias, take(tensors, key), key)

    for attr, name in zip(("w_gate", "w_up", "w_down"), expert_names):
        stacked = _stack_experts(tensors, prefix, name, E)  # [E, in, out]
        assign(getattr(module, attr), stacked, f"{prefix}experts.*.{name}.weight (stacked)")
        del stacked  # streaming conversion: keep at most one stacked weight alive while the next is read

    shared_key = f"{prefix}shared_experts.gate_proj.weight"
    if module.shared is not None:
        load_mlp(module.shared, tensors, f"{prefix}shared_experts.")
    elif shared_key in tensors:
        raise CheckpointError(f"checkpoint has shared experts ({shared_key!r}) but model.moe.num_shared_experts=0")
