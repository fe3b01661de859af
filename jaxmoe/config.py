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

from jaxmoe.config_validation import (  # the constants and the error are defined beside the checks
    ATTENTION_KINDS,
    DTYPES,
    MOE_DISPATCH,
    MXFP4_WEIGHTS,
    ROPE_TYPES,
    ConfigError,
    sharded_dims,
    validate,
    validate_training,
)
from jaxmoe.rules import MESH_AXES

__all__ = [
    "ATTENTION_KINDS", "DTYPES", "MESH_AXES", "MOE_DISPATCH", "MXFP4_WEIGHTS", "ROPE_TYPES", "ConfigError",
    "sharded_dims", "validate", "validate_training",
]  # fmt: skip


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
