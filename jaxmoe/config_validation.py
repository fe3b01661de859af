"""Validation of a :class:`jaxmoe.config.Config`: every cross-field constraint, each error naming
the field and what is allowed (:func:`validate` at load, :func:`validate_training` for a run).

:mod:`jaxmoe.config` imports this module (and re-exports its names), never the other way round.
"""

from __future__ import annotations

import math

from jaxmoe.chat.format import NATIVE_SPECIAL_TOKENS
from jaxmoe.rules import MESH_AXES, RULES, mesh_axes

ATTENTION_KINDS = ("mla", "dsa", "kda")
ROPE_TYPES = ("default", "yarn")
MOE_DISPATCH = ("dense", "dropless", "capacity", "ragged")  # see jaxmoe.moe.experts / expert_parallel
DTYPES = ("float32", "bfloat16")
# Weights that model.mxfp4_weights may name -> the logical name of the dim they contract over
# (MXFP4 blocks of 32 run along it). The routed experts, as gpt-oss quantizes them.
MXFP4_WEIGHTS = {"w_gate": "embed", "w_up": "embed", "w_down": "expert_ffw"}


class ConfigError(ValueError):
    """A configuration field holds a value that is not allowed."""


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def _positive(value: int, field: str) -> None:
    _require(isinstance(value, int) and value > 0, field, f"must be a positive integer, got {value!r}")


def validate(cfg) -> None:
    """Checks every cross-field constraint; raises :class:`ConfigError` naming the field."""
    m, mesh = cfg.model, cfg.mesh
    for a in MESH_AXES:
        _positive(getattr(mesh, a), f"mesh.{a}")
    for f in ("vocab_size", "d_model", "num_layers", "max_context"):
        _positive(getattr(m, f), f"model.{f}")
    _require(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {m.dtype!r}")
    _require(m.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}, got {m.param_dtype!r}")
    _require(
        len(m.layer_kinds) == m.num_layers,
        "model.layer_kinds",
        f"has {len(m.layer_kinds)} entries, model.num_layers is {m.num_layers}: give one kind per layer",
    )
    for i, kind in enumerate(m.layer_kinds):
        _require(
            kind in ATTENTION_KINDS,
            f"model.layer_kinds[{i}]",
            f"unknown attention kind {kind!r}; allowed: {ATTENTION_KINDS}",
        )
    _validate_attention(m)
    _validate_moe(m)
    _validate_mxfp4(cfg)
    _validate_divisibility(cfg)
    _validate_train(cfg)


def _validate_attention(m) -> None:
    kinds = set(m.layer_kinds)
    r = m.rope
    _require(r.type in ROPE_TYPES, "model.rope.type", f"must be one of {ROPE_TYPES}, got {r.type!r}")
    _require(r.theta > 0, "model.rope.theta", f"must be > 0, got {r.theta}")
    if r.type == "yarn":
        _require(r.factor >= 1.0, "model.rope.factor", f"YaRN factor must be >= 1, got {r.factor}")
        _positive(r.original_max_position, "model.rope.original_max_position")

    if kinds & {"mla", "dsa"}:
        a = m.mla
        for f in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _positive(getattr(a, f), f"model.mla.{f}")
        _require(
            a.q_lora_rank >= 0,
            "model.mla.q_lora_rank",
            f"must be >= 0 (0: no q compression), got {a.q_lora_rank}",
        )
        _require(
            a.qk_rope_head_dim > 0 and a.qk_rope_head_dim % 2 == 0,
            "model.mla.qk_rope_head_dim",
            f"must be a positive even number (RoPE rotates pairs), got {a.qk_rope_head_dim}",
        )
    if "dsa" in kinds:
        ix = m.indexer
        for f in ("num_heads", "head_dim", "topk"):
            _positive(getattr(ix, f), f"model.indexer.{f}")
        _require(
            m.mla.q_lora_rank > 0,
            "model.mla.q_lora_rank",
            "dsa layers need q_lora_rank > 0 (the indexer reads the q latent)",
        )
        _require(
            ix.head_dim >= m.mla.qk_rope_head_dim,
            "model.indexer.head_dim",
            f"must be >= model.mla.qk_rope_head_dim={m.mla.qk_rope_head_dim}, got {ix.head_dim}",
        )
    if "kda" in kinds:
        k = m.kda
        for f in ("num_heads", "head_dim", "conv_kernel", "chunk_size"):
            _positive(getattr(k, f), f"model.kda.{f}")
    if m.vision is not None:
        _validate_vision(m)


def _validate_vision(m) -> None:
    v = m.vision
    for f in ("patch_size", "pos_emb_height", "pos_emb_width", "num_heads", "num_layers", "hidden_size",
              "intermediate_size", "merge_height", "merge_width"):  # fmt: skip
        _positive(getattr(v, f), f"model.vision.{f}")
    _require(
        v.hidden_size % v.num_heads == 0,
        "model.vision.hidden_size",
        f"{v.hidden_size} is not divisible by model.vision.num_heads={v.num_heads}",
    )
    _require(
        v.head_dim % 4 == 0,
        "model.vision.num_heads",
        f"the head dim hidden_size / num_heads = {v.head_dim} must be a multiple of 4 (2D RoPE: two axes of pairs)",
    )
    _require(v.rope_theta > 0, "model.vision.rope_theta", f"must be > 0, got {v.rope_theta}")
    _require(
        0 <= v.image_token_id < m.vocab_size,
        "model.vision.image_token_id",
        f"must be a token id in [0, model.vocab_size={m.vocab_size}), got {v.image_token_id}",
    )


def _validate_moe(m) -> None:
    e = m.moe
    for f in ("num_experts", "experts_per_token", "expert_ffw_dim", "num_groups", "topk_groups"):
        _positive(getattr(e, f), f"model.moe.{f}")
    _require(e.num_shared_experts >= 0, "model.moe.num_shared_experts", f"must be >= 0, got {e.num_shared_experts}")
    _require(
        0 <= e.first_k_dense <= m.num_layers,
        "model.moe.first_k_dense",
        f"must be in [0, {m.num_layers}] (the layer count), got {e.first_k_dense}",
    )
    if e.first_k_dense:
        _positive(e.dense_ffw_dim, "model.moe.dense_ffw_dim")
    _require(e.dispatch in MOE_DISPATCH, "model.moe.dispatch", f"must be one of {MOE_DISPATCH}, got {e.dispatch!r}")
    _require(e.capacity_factor > 0, "model.moe.capacity_factor", f"must be > 0, got {e.capacity_factor}")
    _require(
        e.experts_per_token <= e.num_experts,
        "model.moe.experts_per_token",
        f"top-k {e.experts_per_token} is larger than model.moe.num_experts={e.num_experts}",
    )
    _require(
        e.num_experts % e.num_groups == 0,
        "model.moe.num_groups",
        f"must divide model.moe.num_experts={e.num_experts}, got {e.num_groups}",
    )
    _require(
        e.num_experts // e.num_groups >= 2,
        "model.moe.num_groups",
        f"each group needs >= 2 experts (group score is the sum of its top 2), got {e.num_experts // e.num_groups}",
    )
    _require(
        e.topk_groups <= e.num_groups,
        "model.moe.topk_groups",
        f"must be <= model.moe.num_groups={e.num_groups}, got {e.topk_groups}",
    )
    _require(
        e.experts_per_token <= e.topk_groups * (e.num_experts // e.num_groups),
        "model.moe.experts_per_token",
        f"top-k {e.experts_per_token} exceeds the experts in the {e.topk_groups} selected groups",
    )


def sharded_dims(m) -> dict[str, list[tuple[str, int]]]:
    """Logical axis name -> the config fields whose values size a dimension with that name."""
    dims: dict[str, list[tuple[str, int]]] = {
        "vocab": [("model.vocab_size", m.vocab_size)],
        "embed": [("model.d_model", m.d_model)],
        "experts": [("model.moe.num_experts", m.moe.num_experts)],
        "expert_ffw": [("model.moe.expert_ffw_dim", m.moe.expert_ffw_dim)],
        "heads": [],
        "ffw": [],
    }
    if m.moe.num_shared_experts:
        dims["ffw"].append(
            ("model.moe.expert_ffw_dim*num_shared_experts", m.moe.expert_ffw_dim * m.moe.num_shared_experts)
        )
    if m.moe.first_k_dense:
        dims["ffw"].append(("model.moe.dense_ffw_dim", m.moe.dense_ffw_dim))
    kinds = set(m.layer_kinds)
    if kinds & {"mla", "dsa"}:
        dims["heads"].append(("model.mla.num_heads", m.mla.num_heads))
        dims["kv_lora"] = [("model.mla.kv_lora_rank", m.mla.kv_lora_rank)]
        if m.mla.q_lora_rank:
            dims["q_lora"] = [("model.mla.q_lora_rank", m.mla.q_lora_rank)]
    if "dsa" in kinds:
        dims["heads"].append(("model.indexer.num_heads", m.indexer.num_heads))
    if "kda" in kinds:
        dims["heads"].append(("model.kda.num_heads", m.kda.num_heads))
    if m.vision is not None:
        v = m.vision
        dims["embed"].append(("model.vision.hidden_size", v.hidden_size))
        dims["heads"].append(("model.vision.num_heads", v.num_heads))
        dims["ffw"] += [
            ("model.vision.intermediate_size", v.intermediate_size),
            ("model.vision.hidden_size*merge_height*merge_width", v.hidden_size * v.merge_size),
        ]
    return dims


def _validate_mxfp4(cfg) -> None:
    m = cfg.model
    for i, name in enumerate(m.mxfp4_weights):
        _require(
            name in MXFP4_WEIGHTS,
            f"model.mxfp4_weights[{i}]",
            f"unknown weight {name!r}; allowed: {tuple(MXFP4_WEIGHTS)}",
        )
    _require(
        len(set(m.mxfp4_weights)) == len(m.mxfp4_weights), "model.mxfp4_weights", f"repeats a name: {m.mxfp4_weights}"
    )
    # Blocks of 32 run along the contracting dim, and the mesh axes that shard it shard the blocks.
    for name in m.mxfp4_weights:
        logical = MXFP4_WEIGHTS[name]
        axes = mesh_axes(dict(RULES).get(logical))
        size = 32 * math.prod(getattr(cfg.mesh, a) for a in axes)
        for field, value in sharded_dims(m)[logical][:1]:
            _require(
                value % size == 0,
                field,
                f"{value} is not divisible by {size} = 32 (MXFP4 block, {name} in model.mxfp4_weights) x "
                f"{'x'.join(f'mesh.{a}' for a in axes) or '1'}",
            )


def _validate_divisibility(cfg) -> None:
    rules = dict(RULES)
    for logical, fields in sharded_dims(cfg.model).items():
        axes = mesh_axes(rules.get(logical))
        if not axes:
            continue
        size = math.prod(getattr(cfg.mesh, a) for a in axes)
        for field, value in fields:
            _require(
                value % size == 0,
                field,
                f"{value} is not divisible by the mesh axes {'x'.join(f'mesh.{a}' for a in axes)}={size} "
                f"that shard the '{logical}' dimension",
            )


def _validate_train(cfg) -> None:
    """Ranges of the training fields (mesh-dependent checks: :func:`validate_training`)."""
    t, o = cfg.train, cfg.train.optim
    for f in ("steps", "batch_size", "seq_len", "log_every", "eval_batches", "keep_checkpoints"):
        _positive(getattr(t, f), f)
    for f in ("eval_every", "checkpoint_every"):
        _require(getattr(t, f) >= 0, f, f"must be >= 0 (0: only at the end), got {getattr(t, f)}")
    _require(t.peak_flops >= 0, "peak_flops", f"must be >= 0 (0: measure), got {t.peak_flops}")
    _require(o.learning_rate > 0, "optim.learning_rate", f"must be > 0, got {o.learning_rate}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    for f in ("b1", "b2"):
        _require(0 <= getattr(o, f) < 1, f"optim.{f}", f"must be in [0, 1), got {getattr(o, f)}")
    _require(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _require(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0: no clipping), got {o.grad_clip}")
    b = t.moe_balance
    _require(b.bias_rate >= 0, "moe_balance.bias_rate", f"must be >= 0, got {b.bias_rate}")
    _require(
        b.seq_aux_loss_weight >= 0, "moe_balance.seq_aux_loss_weight", f"must be >= 0, got {b.seq_aux_loss_weight}"
    )
    d = t.dsa
    _require(d.warmup_steps >= 0, "dsa.warmup_steps", f"must be >= 0, got {d.warmup_steps}")
    _require(d.warmup_learning_rate > 0, "dsa.warmup_learning_rate", f"must be > 0, got {d.warmup_learning_rate}")
    _require(d.indexer_loss_weight >= 0, "dsa.indexer_loss_weight", f"must be >= 0, got {d.indexer_loss_weight}")
    _positive(t.data.max_bytes, "data.max_bytes")
    _require(
        0 < t.data.heldout_fraction < 1, "data.heldout_fraction", f"must be in (0, 1), got {t.data.heldout_fraction}"
    )


# The locally trained byte-level BPE (jaxmoe.chat.tokenizer): the special tokens, 256 bytes, then one id per merge.
TOKENIZER_MIN_VOCAB = 256 + len(NATIVE_SPECIAL_TOKENS)


def validate_training(cfg) -> None:
    """What ``jaxmoe train`` needs beyond :func:`validate`: shapes that fit the mesh, the tokenizer.

    Raises:
        ConfigError: naming the field and what is allowed.
    """
    t, m, mesh = cfg.train, cfg.model, cfg.mesh
    _require(t.seq_len <= m.max_context, "seq_len", f"{t.seq_len} is longer than model.max_context={m.max_context}")
    batch_shards = mesh.data * mesh.fsdp * mesh.expert
    _require(
        t.batch_size % batch_shards == 0,
        "batch_size",
        f"{t.batch_size} is not divisible by mesh.data x mesh.fsdp x mesh.expert = {batch_shards} "
        "(the axes that split the batch)",
    )
    kinds = set(m.layer_kinds)
    if mesh.context > 1:
        multiple = 2 * mesh.context if kinds & {"mla", "dsa"} else mesh.context
        why = "zig-zag ring attention of mla/dsa layers" if kinds & {"mla", "dsa"} else "one block per shard"
        _require(
            t.seq_len % multiple == 0,
            "seq_len",
            f"{t.seq_len} is not divisible by {multiple} = {multiple // mesh.context} x mesh.context ({why})",
        )
        if "kda" in kinds:
            _require(
                t.seq_len // mesh.context >= m.kda.conv_kernel - 1,
                "seq_len",
                f"{t.seq_len} gives {t.seq_len // mesh.context} tokens per context shard; kda layers need at "
                f"least model.kda.conv_kernel - 1 = {m.kda.conv_kernel - 1}",
            )
    _require(
        m.vocab_size >= TOKENIZER_MIN_VOCAB,
        "model.vocab_size",
        f"{m.vocab_size} is below the tokenizer's minimum {TOKENIZER_MIN_VOCAB} "
        f"(256 bytes + {len(NATIVE_SPECIAL_TOKENS)} special tokens)",
    )
    _require(
        not m.mxfp4_weights,
        "model.mxfp4_weights",
        f"training keeps float weights, got {m.mxfp4_weights}; set export_mxfp4 for an MXFP4 copy at the end",
    )
    if t.dsa.warmup_steps:
        _require(
            "dsa" in kinds,
            "dsa.warmup_steps",
            f"is {t.dsa.warmup_steps} but model.layer_kinds {m.layer_kinds} has no dsa layer",
        )
