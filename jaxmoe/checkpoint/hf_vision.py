"""HF ``kimi_k25`` checkpoints: the names ``save_pretrained`` writes, and the vision tower's weights.

``save_pretrained`` of ``Kimi_K25ForConditionalGeneration`` writes Moonshot's original names:
the language model under ``language_model.model.blocks.N`` (``language_model.lm_head`` when not
tied), the tower under ``vision_tower.encoder.blocks.N`` (``norm0``/``norm1``, fused ``wqkv`` with
each head's rotary pairs interleaved, ``wo``, ``mlp.fc0``/``mlp.fc1``), the position table as
``vision_tower.patch_embed.pos_emb.weight`` and the projector as ``mm_projector.proj.{0,2}`` beside
``model.mm_projector.pre_norm``. :func:`kimi_k25_name` maps them onto one canonical form (the text
model's as for ``deepseek_v3``: ``model.layers.N``, ``model.embed_tokens``, ``model.norm``,
``lm_head``), so the ``deepseek_v3`` loader reads the language model unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from jaxmoe.checkpoint.hf_common import assign, take
from jaxmoe.errors import CheckpointError
from jaxmoe.vision import VisionTower

_RENAMES = (
    (re.compile(r"^language_model\.model\.blocks\.(\d+)\."), r"model.layers.\1."),
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^model\.mm_projector\."), "mm_projector."),
    (re.compile(r"^vision_tower\.encoder\.patch_embed\.pos_emb\."), "vision_tower.patch_embed.pos_emb."),
)


def kimi_k25_name(key: str) -> str:
    """The canonical name of a stored ``kimi_k25`` tensor."""
    for pattern, repl in _RENAMES:
        key, n = pattern.subn(repl, key)
        if n:
            break
    return key


def _load(variable, tensors: Mapping[str, np.ndarray], key: str, convert=lambda a: a) -> None:
    value = take(tensors, key)
    try:
        value = convert(value)
    except ValueError as e:
        raise CheckpointError(f"tensor {key!r} has shape {value.shape}, which does not fit: {e}") from e
    assign(variable, value, key)


def load_vision(tower: VisionTower, tensors: Mapping[str, np.ndarray]) -> None:
    """Copies the tower's and the projector's tensors into ``tower`` in place."""
    cfg = tower.cfg
    E, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    p = "vision_tower.encoder."
    _load(tower.patch_embed, tensors, p + "patch_embed.proj.weight", lambda w: w.reshape(w.shape[0], -1).T)
    _load(tower.patch_bias, tensors, p + "patch_embed.proj.bias")
    _load(tower.pos_embed, tensors, "vision_tower.patch_embed.pos_emb.weight", lambda w: w.reshape(-1, w.shape[-1]))
    for i, block in enumerate(tower.blocks):
        b = f"{p}blocks.{i}."
        for ours, theirs in ((block.norm1, "norm0"), (block.norm2, "norm1")):
            _load(ours.weight, tensors, b + theirs + ".weight")
            _load(ours.bias, tensors, b + theirs + ".bias")
        _load(block.wqkv, tensors, b + "wqkv.weight", lambda w: w.T.reshape(E, 3, N, H))
        _load(block.bqkv, tensors, b + "wqkv.bias", lambda w: w.reshape(3, N, H))
        _load(block.wo, tensors, b + "wo.weight", lambda w: w.T.reshape(N, H, E))
        _load(block.bo, tensors, b + "wo.bias")
        _load(block.fc1, tensors, b + "mlp.fc0.weight", lambda w: w.T)
        _load(block.b1, tensors, b + "mlp.fc0.bias")
        _load(block.fc2, tensors, b + "mlp.fc1.weight", lambda w: w.T)
        _load(block.b2, tensors, b + "mlp.fc1.bias")
    _load(tower.final_norm.weight, tensors, p + "final_layernorm.weight")
    _load(tower.final_norm.bias, tensors, p + "final_layernorm.bias")
    _load(tower.proj_norm.weight, tensors, "mm_projector.pre_norm.weight")
    _load(tower.proj_norm.bias, tensors, "mm_projector.pre_norm.bias")
    _load(tower.proj_in, tensors, "mm_projector.proj.0.weight", lambda w: w.T)
    _load(tower.proj_in_bias, tensors, "mm_projector.proj.0.bias")
    _load(tower.proj_out, tensors, "mm_projector.proj.2.weight", lambda w: w.T)
    _load(tower.proj_out_bias, tensors, "mm_projector.proj.2.bias")


def vision_config(hf: Mapping) -> dict:
    """The ``model.vision`` section of a ``kimi_k25`` ``config.json``; unsupported settings refused."""
    from jaxmoe.config import ConfigError  # noqa: PLC0415

    v = hf.get("vision_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"HF vision_config.hidden_act={act!r} is not supported; allowed: 'gelu_pytorch_tanh'")
    rope = v.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 10000.0}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"HF vision_config.rope_parameters.rope_type={rope['rope_type']!r}; allowed: 'axial'")
    merge = list(v.get("merge_kernel_size", (2, 2)))
    if len(merge) != 2:
        raise ConfigError(f"HF vision_config.merge_kernel_size must have 2 entries, got {merge}")
    hidden = int(v.get("hidden_size", 1152))
    projected = hf.get("projection_hidden_size") or hidden
    if int(projected) != hidden:
        raise ConfigError(
            f"HF config projection_hidden_size={projected} must equal vision_config.hidden_size={hidden} "
            "(the projector normalises each patch before merging)"
        )
    return dict(
        patch_size=int(v.get("patch_size", 14)),
        pos_emb_height=int(v.get("pos_emb_height", 64)),
        pos_emb_width=int(v.get("pos_emb_width", 64)),
        num_heads=int(v.get("num_attention_heads", 16)),
        num_layers=int(v.get("num_hidden_layers", 27)),
        hidden_size=hidden,
        intermediate_size=int(v.get("intermediate_size", 4304)),
        merge_height=int(merge[0]),
        merge_width=int(merge[1]),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        projection_norm_eps=float(hf.get("projection_layer_norm_eps", 1e-5)),
        image_token_id=int(hf.get("image_token_id", 163605)),
    )
