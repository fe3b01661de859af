"""Import HF transformers checkpoints (``deepseek_v3``, ``deepseek_v32``, ``kimi_linear``, ``kimi_k25``).

``kimi_k25`` (Kimi K2.5: a MoonViT vision tower and projector over a ``deepseek_v3`` language
model) is read through :mod:`jaxmoe.checkpoint.hf_vision`, its stored names mapped onto the
``deepseek_v3`` ones.

Reads the folder ``save_pretrained`` writes: ``config.json`` plus ``model.safetensors`` or
sharded ``model-*.safetensors`` with ``model.safetensors.index.json``; routed experts stored per
expert (``mlp.experts.{e}.gate_proj.weight``). Every tensor the model needs must be present and
of the right shape, and every tensor in the checkpoint must be used (except the multi-token
prediction layers DeepSeek ships beyond ``num_hidden_layers``), so nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Mapping

import numpy as np
from flax import nnx

from jaxmoe.checkpoint.hf_attention import load_dsa, load_mla
from jaxmoe.checkpoint.hf_common import assign, take
from jaxmoe.checkpoint.hf_kda import load_kda
from jaxmoe.checkpoint.hf_moe import DEEPSEEK_EXPERT_NAMES, KIMI_EXPERT_NAMES, load_mlp, load_moe
from jaxmoe.checkpoint.hf_vision import kimi_k25_name, load_vision, vision_config
from jaxmoe.checkpoint.safetensors_folder import SafetensorsFolder
from jaxmoe.config import Config, ConfigError, MeshConfig, from_config_dict
from jaxmoe.errors import CheckpointError

SUPPORTED = ("deepseek_v3", "deepseek_v32", "kimi_linear", "kimi_k25")


def _get(hf: Mapping, key: str, default=None, required: bool = False):
    if key in hf and hf[key] is not None:
        return hf[key]
    if required:
        raise ConfigError(f"HF config.json has no field {key!r}")
    return default


def _rope(hf: Mapping) -> dict:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"HF config rope_parameters.rope_type={kind!r} is not supported; allowed: default, yarn")
    rope = dict(theta=float(theta), type=kind)
    if kind == "yarn":
        factor = params.get("factor")
        orig = params.get("original_max_position_embeddings")
        if factor is None:
            factor = hf["max_position_embeddings"] / orig
        rope.update(
            factor=float(factor),
            original_max_position=int(orig),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            truncate=bool(params.get("truncate", True)),
        )
        if params.get("attention_factor") is not None:
            raise ConfigError("HF config rope_parameters.attention_factor is not supported (derived from mscale)")
    return rope


def _first_k_dense(hf: Mapping, n_layers: int) -> int:
    types = hf.get("mlp_layer_types")
    if types is None:
        return int(_get(hf, "first_k_dense_replace", 0))
    k = sum(1 for t in types if t == "dense")
    if list(types) != ["dense"] * k + ["sparse"] * (n_layers - k):
        raise ConfigError(f"HF config mlp_layer_types must be dense layers then sparse layers, got {types}")
    return k


def config_from_hf(hf: Mapping) -> Config:
    """Maps an HF ``config.json`` dict onto a validated jaxmoe :class:`Config`."""
    model_type = hf.get("model_type")
    if model_type == "kimi_k25":
        text = dict(hf.get("text_config") or {})
        if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
            raise ConfigError(
                f"HF kimi_k25 text_config.model_type={text['model_type']!r} is not supported; allowed: 'deepseek_v3'"
            )
        model = _text_model(dict(text, model_type="deepseek_v3"))
        # The multimodal model ties its LM head at the top level, whatever the text config says.
        model["tie_embeddings"] = bool(hf.get("tie_word_embeddings", True))
        model["vision"] = vision_config(hf)
        return from_config_dict(dict(model=model, mesh={}, name="hf_kimi_k25"))
    return from_config_dict(dict(model=_text_model(hf), mesh={}, name=f"hf_{model_type}"))


def tensor_names(hf: Mapping):
    """How the stored tensor names of the family map onto the loaders' (None: as stored)."""
    return kimi_k25_name if hf.get("model_type") == "kimi_k25" else None


def _text_model(hf: Mapping) -> dict:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(f"HF config model_type={model_type!r} is not supported; allowed: {SUPPORTED}")
    if _get(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"HF config hidden_act={hf['hidden_act']!r} is not supported; allowed: 'silu'")
    if hf.get("attention_bias"):
        raise ConfigError("HF config attention_bias=true is not supported")
    n_layers = int(_get(hf, "num_hidden_layers", required=True))
    if model_type == "deepseek_v3":
        if not hf.get("rope_interleave", True):
            raise ConfigError(
                "HF config rope_interleave=false is not supported for deepseek_v3 (MLA RoPE is interleaved)"
            )
        kinds = ("mla",) * n_layers
    elif model_type == "deepseek_v32":
        kinds = ("dsa",) * n_layers
    else:
        types = hf.get("layer_types")
        if types is None:
            raise ConfigError("HF kimi_linear config has no layer_types")
        mapping = {"full_attention": "mla", "linear_attention": "kda"}
        bad = [t for t in types if t not in mapping]
        if bad:
            raise ConfigError(f"HF config layer_types holds {bad[0]!r}; allowed: {sorted(mapping)}")
        kinds = tuple(mapping[t] for t in types)
    if len(kinds) != n_layers:
        raise ConfigError(f"HF config layer_types has {len(kinds)} entries, num_hidden_layers is {n_layers}")
    q_lora = hf.get("q_lora_rank") or 0
    model = dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        num_layers=n_layers,
        layer_kinds=kinds,
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        max_context=int(_get(hf, "max_position_embeddings") or _get(hf, "model_max_length", 4096)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope=_rope(hf) if model_type != "kimi_linear" else dict(type="default"),
        mla=dict(
            num_heads=int(hf["num_attention_heads"]),
            q_lora_rank=int(q_lora),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            use_rope=model_type != "kimi_linear",
        ),
        moe=dict(
            num_experts=int(_get(hf, "n_routed_experts") or _get(hf, "num_experts", required=True)),
            experts_per_token=int(_get(hf, "num_experts_per_tok") or _get(hf, "num_experts_per_token", required=True)),
            num_shared_experts=int(_get(hf, "n_shared_experts", _get(hf, "num_shared_experts", 0))),
            expert_ffw_dim=int(hf["moe_intermediate_size"]),
            dense_ffw_dim=int(hf["intermediate_size"]),
            num_groups=int(_get(hf, "n_group", _get(hf, "num_expert_group", 1))),
            topk_groups=int(_get(hf, "topk_group", 1)),
            routed_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(_get(hf, "norm_topk_prob", _get(hf, "moe_renormalize", True))),
            first_k_dense=_first_k_dense(hf, n_layers),
        ),
    )
    if model_type == "deepseek_v32":
        model["indexer"] = dict(
            num_heads=int(hf["index_n_heads"]), head_dim=int(hf["index_head_dim"]), topk=int(hf["index_topk"])
        )
    if model_type == "kimi_linear":
        model["kda"] = dict(
            num_heads=int(hf["linear_num_heads"]),
            head_dim=int(hf["linear_head_dim"]),
            conv_kernel=int(hf["linear_conv_kernel_dim"]),
        )
    return model


# Saved FFN block name and routed-expert (gate, up, down) names per family: Kimi Linear keeps the
# original checkpoint's names, which transformers renames only in memory.
FFN_LAYOUT = {
    "deepseek_v3": ("mlp.", DEEPSEEK_EXPERT_NAMES),
    "deepseek_v32": ("mlp.", DEEPSEEK_EXPERT_NAMES),
    "kimi_linear": ("block_sparse_moe.", KIMI_EXPERT_NAMES),
    "kimi_k25": ("mlp.", DEEPSEEK_EXPERT_NAMES),  # its deepseek_v3 text model, names mapped (hf_vision)
}


def load_weights(model, tensors: Mapping[str, np.ndarray], model_type: str) -> None:
    """Copies every HF tensor into ``model`` (a :class:`jaxmoe.model.Transformer`) in place."""
    cfg = model.cfg
    ffn_prefix, expert_names = FFN_LAYOUT[model_type]
    assign(model.embed, take(tensors, "model.embed_tokens.weight"), "model.embed_tokens.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        assign(layer.attn_norm.weight, take(tensors, p + "input_layernorm.weight"), p + "input_layernorm.weight")
        assign(
            layer.ffn_norm.weight,
            take(tensors, p + "post_attention_layernorm.weight"),
            p + "post_attention_layernorm.weight",
        )
        loader = {"mla": load_mla, "dsa": load_dsa, "kda": load_kda}[layer.kind]
        loader(layer.attn, tensors, p + "self_attn.")
        if i < cfg.moe.first_k_dense:
            load_mlp(layer.ffn, tensors, p + ffn_prefix)
        else:
            load_moe(layer.ffn, tensors, p + ffn_prefix, expert_names)
    assign(model.final_norm.weight, take(tensors, "model.norm.weight"), "model.norm.weight")
    if not cfg.tie_embeddings:
        assign(model.lm_head, take(tensors, "lm_head.weight").T, "lm_head.weight")
    if cfg.vision is not None:
        load_vision(model.vision, tensors)


def read_hf_config(src: pathlib.Path) -> dict:
    """The ``config.json`` of the HF folder ``src``, as a dict."""
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(src)!r} is not an HF checkpoint folder: it has no config.json")
    return json.loads(cfg_file.read_text())


def refuse_unused(tensors: SafetensorsFolder, src: pathlib.Path, n_layers: int) -> None:
    """Raises unless every stored tensor was read, bar DeepSeek's multi-token-prediction layers."""
    extra = _mtp_free(set(tensors.stored) - tensors.used, n_layers)
    if extra:
        raise CheckpointError(
            f"checkpoint {str(src)!r} holds {len(extra)} tensors the model does not use, e.g. {sorted(extra)[:3]}"
        )


def import_hf(src: str | pathlib.Path, mesh: MeshConfig | None = None):
    """Reads an HF folder; returns ``(cfg, model)`` with the weights loaded on the host."""
    from jaxmoe.model import Transformer  # noqa: PLC0415 (the model imports every module)

    src = pathlib.Path(src)
    hf = read_hf_config(src)
    cfg = config_from_hf(hf)
    if mesh is not None:
        cfg = dataclasses.replace(cfg, mesh=mesh)
    tensors = SafetensorsFolder(src, rename=tensor_names(hf))
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    load_weights(model, tensors, hf["model_type"])
    refuse_unused(tensors, src, cfg.model.num_layers)
    return cfg, model


def _mtp_free(keys: set[str], n_layers: int) -> set[str]:
    """Drops DeepSeek's multi-token-prediction layers (indices >= num_hidden_layers) from ``keys``."""
    out = set()
    for k in keys:
        m = re.match(r"model\.layers\.(\d+)\.", k)
        if m and int(m.group(1)) >= n_layers:
            continue
        out.add(k)
    return out
