"""Typed, frozen configuration: the only thing model code reads.

ml_collections ``ConfigDict`` files (``configs/*.py`` with ``get_config()``) are the user-facing
edge; :func:`from_config_dict` turns one into the dataclasses below, validating every field and
naming the bad one in the error. Unknown keys are refused rather than ignored.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
from collections.abc import Mapping
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding; YaRN as in DeepSeek-V3 when ``type == 'yarn'``."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (shared by ``mla`` and ``dsa`` layers)."""

    num_heads: int = 4
    q_lora_rank: int = 0  # 0: queries come straight from x (no low-rank q, as in Kimi Linear)
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 8
    v_head_dim: int = 8
    use_rope: bool = True  # False: NoPE MLA (Kimi Linear's full-attention layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """DSA lightning indexer."""

    num_heads: int = 4
    head_dim: int = 16
    topk: int = 2048


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi delta attention."""

    num_heads: int = 4
    head_dim: int = 8
    conv_kernel: int = 4
    chunk_size: int = 64


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-style MoE FFN (and the dense FFN of the first ``first_k_dense`` layers)."""

    num_experts: int = 8
    experts_per_token: int = 2
    num_shared_experts: int = 1
    expert_ffw_dim: int = 16
    dense_ffw_dim: int = 48
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense: int = 0
    dispatch: str = "dense"
    # "capacity": an expert takes ceil(capacity_factor * n * K / E) of a shard's n tokens; the rest drop (counted)
    capacity_factor: float = 1.25


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A MoonViT vision tower and its projector (Kimi K2.5's image input, :mod:`jaxmoe.vision`).

    Patches of ``patch_size`` pixels get a learned position table of ``pos_emb_height x
    pos_emb_width`` (resampled bicubically to each image's grid) and 2D rotary angles; each image
    attends within itself; ``merge_height x merge_width`` neighbouring patches are merged into one
    language-model token by the projector. An image enters the sequence at ``image_token_id``
    placeholders, one per merged patch.
    """

    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    num_heads: int = 16
    num_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    merge_height: int = 2
    merge_width: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    projection_norm_eps: float = 1e-5
    image_token_id: int = 163605

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_size(self) -> int:
        return self.merge_height * self.merge_width


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 32
    num_layers: int = 1
    layer_kinds: tuple[str, ...] = ("mla",)  # one attention kind per layer, len == num_layers
    norm_eps: float = 1e-6
    max_context: int = 4096
    tie_embeddings: bool = False
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # Weights stored packed in MXFP4 (jaxmoe.quant), e.g. ("w_gate", "w_up", "w_down"): the routed experts.
    mxfp4_weights: tuple[str, ...] = ()
    init_std: float = 0.02
    rope: RopeConfig = RopeConfig()
    mla: MLAConfig = MLAConfig()
    indexer: IndexerConfig = IndexerConfig()
    kda: KDAConfig = KDAConfig()
    moe: MoEConfig = MoEConfig()
    vision: VisionConfig | None = None  # None: text only


# Sections that are absent (None) unless the config gives them.
OPTIONAL_SECTIONS = {"vision": VisionConfig}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the five mesh axes; their product is the device count."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay, and global-norm gradient clipping."""

    learning_rate: float = 3e-3  # peak
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # the cosine ends at learning_rate * min_lr_ratio on the last step
    weight_decay: float = 0.1  # decoupled; matrices only (not norms, not the router bias)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping


@dataclasses.dataclass(frozen=True)
class MoEBalanceConfig:
    """DeepSeek-V3 load balancing: the aux-loss-free bias update and the sequence-wise aux loss."""

    bias_rate: float = 1e-3  # gamma: router_bias += bias_rate * sign(mean load - load) after each step
    seq_aux_loss_weight: float = 0.0  # alpha of the sequence-wise balance loss (DeepSeek-V3: 1e-4)


@dataclasses.dataclass(frozen=True)
class DSATrainConfig:
    """DeepSeek-V3.2 indexer training: a dense warm-up, then the sparse stage."""

    warmup_steps: int = 0  # first steps: dense attention, only the indexer trains (KL loss)
    warmup_learning_rate: float = 1e-3  # the indexer's (constant) rate during the warm-up
    indexer_loss_weight: float = 1.0  # sparse stage: LM loss + this x indexer KL (indexer input detached)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The corpus (Python standard library sources) and its tokenized cache (jaxmoe.data)."""

    max_bytes: int = 4_000_000  # corpus text taken
    heldout_fraction: float = 0.02  # documents held out for the held-out loss
    cache_dir: str = ""  # "" : <workdir>/data_cache


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training job (``jaxmoe train``). In config files these keys sit at the top level."""

    steps: int = 100
    seed: int = 0  # parameter init and data order
    batch_size: int = 8  # global, in sequences
    seq_len: int = 128
    remat: bool = False  # recompute each decoder layer's activations in the backward pass
    scan_layers: bool = False  # repeating blocks of layers stacked, run by lax.scan (jaxmoe.layer_plan)
    log_every: int = 1
    eval_every: int = 50  # held-out loss every N steps and at the end; 0: only at the end
    eval_batches: int = 4
    checkpoint_every: int = 50  # 0: only at the end
    keep_checkpoints: int = 3
    export_mxfp4: bool = True  # at the end: an MXFP4 model checkpoint of the final params
    peak_flops: float = 0.0  # per device, for mfu; 0: measured at start (jitted f32 matmul)
    optim: OptimConfig = OptimConfig()
    moe_balance: MoEBalanceConfig = MoEBalanceConfig()
    dsa: DSATrainConfig = DSATrainConfig()
    data: DataConfig = DataConfig()


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    name: str = "unnamed"
    train: TrainConfig = TrainConfig()


SECTIONS = ("model", "mesh", "name")  # top-level keys that are not training keys
TRAIN_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))


# --------------------------------------------------------------------------------------------
# ConfigDict -> dataclasses


def _to_plain(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, Mapping):
        return {k: _to_plain(v) for k, v in x.items()}
    return x


def _build(cls, values: Mapping[str, Any], prefix: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config field {prefix}{unknown[0]}; allowed fields of {prefix.rstrip('.') or 'config'}: "
            f"{sorted(fields)}"
        )
    kwargs = {}
    for name, value in values.items():
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if cls is ModelConfig and name in OPTIONAL_SECTIONS:
            if value is None:
                kwargs[name] = None
                continue
            default = OPTIONAL_SECTIONS[name]()
        if dataclasses.is_dataclass(default):
            if not isinstance(value, Mapping):
                raise ConfigError(f"config field {prefix}{name} must be a mapping of fields, got {value!r}")
            kwargs[name] = _build(type(default), value, f"{prefix}{name}.")
            continue
        if name in ("layer_kinds", "mxfp4_weights"):
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            value = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"config field {prefix}{name} must be a bool, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config field {prefix}{name} must be an int, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"config field {prefix}{name} must be a number, got {value!r}")
            value = float(value)
        elif isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"config field {prefix}{name} must be a string, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def _train_values(d: Mapping[str, Any]) -> dict[str, Any]:
    """The training keys: top-level in config files, or a ``train`` section (``dataclasses.asdict``)."""
    top = {k: v for k, v in d.items() if k not in (*SECTIONS, "train")}
    unknown = sorted(set(top) - set(TRAIN_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown config field {unknown[0]}; allowed top-level fields: {sorted((*SECTIONS, *TRAIN_KEYS))}"
        )
    nested = d.get("train", {})
    if not isinstance(nested, Mapping):
        raise ConfigError(f"config field train must be a mapping of training fields, got {nested!r}")
    both = sorted(set(top) & set(nested))
    if both:
        raise ConfigError(f"config field {both[0]} is given both at the top level and in train; give it once")
    return {**nested, **top}


def from_config_dict(cd: Any) -> Config:
    """Turns a ConfigDict (or plain nested dict) into a validated :class:`Config`.

    ``model``, ``mesh`` and ``name`` are sections; every other top-level key is a training field
    (:class:`TrainConfig`), e.g. ``steps`` or ``optim.learning_rate``. The nested form that
    ``dataclasses.asdict(Config)`` writes (``train={...}``) is read too, so stored configs round-trip.
    """
    d = _to_plain(cd)
    if not isinstance(d, Mapping) or "model" not in d:
        raise ConfigError("config must have a 'model' section")
    cfg = Config(
        model=_build(ModelConfig, d["model"], "model."),
        mesh=_build(MeshConfig, d.get("mesh", {}), "mesh."),
        name=str(d.get("name", "unnamed")),
        train=_build(TrainConfig, _train_values(d), ""),
    )
    validate(cfg)
    return cfg


def load_config(path: str | pathlib.Path, arg: str | None = None) -> Config:
    """Loads ``get_config(arg)`` from an ml_collections config file and validates it."""
    return from_config_dict(load_config_dict(path, arg))


def load_config_dict(path: str | pathlib.Path, arg: str | None = None):
    """``get_config(arg)`` of a config file; ``FILE:ARG`` (ml_collections style) passes ARG too."""
    if arg is None and not pathlib.Path(path).is_file() and ":" in str(path):
        path, arg = str(path).rsplit(":", 1)
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_jaxmoe_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {str(path)!r} defines no get_config()")
    return module.get_config(arg) if arg is not None else module.get_config()


# --------------------------------------------------------------------------------------------
# Validation


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def _positive(value: int, field: str) -> None:
    _require(isinstance(value, int) and value > 0, field, f"must be a positive integer, got {value!r}")


def validate(cfg: Config) -> None:
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


def _validate_attention(m: ModelConfig) -> None:
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


def _validate_vision(m: ModelConfig) -> None:
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


def _validate_moe(m: ModelConfig) -> None:
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


def sharded_dims(m: ModelConfig) -> dict[str, list[tuple[str, int]]]:
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


def _validate_mxfp4(cfg: Config) -> None:
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


def _validate_divisibility(cfg: Config) -> None:
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


def _validate_train(cfg: Config) -> None:
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


def validate_training(cfg: Config) -> None:
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
