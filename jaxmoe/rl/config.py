"""The RL job's configuration: the ``rl`` section of a config file, next to the model and mesh.

    c = <a training config>          # model, mesh: the model the --init checkpoint holds
    c.rl = dict(steps=40, group_size=8, domains=("code", "tool_args", "budget"), ...)

``jaxmoe rl --config FILE`` reads the training part with :func:`jaxmoe.config.from_config_dict`
(the ``rl`` section taken out first) and the ``rl`` section into :class:`RLConfig`;
``--config.rl.KEY=VALUE`` sets a field of the section, any other ``--config.KEY=VALUE`` the
training part, as for ``jaxmoe train``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxmoe.config import Config, ConfigError, OptimConfig, _build, _to_plain, from_config_dict, load_config_dict
from jaxmoe.sharding import logical_to_spec
from jaxmoe.train.overrides import apply_overrides, section_overrides

TIERS = ("low", "high", "max")


@dataclasses.dataclass(frozen=True)
class ThinkingBudgets:
    """Reasoning tokens of each tier during rollouts (the engine forces the end of thinking there)."""

    low: int = 4
    high: int = 8
    max: int = 16


@dataclasses.dataclass(frozen=True)
class ColdStart:
    """Supervised steps on the domains' demonstrations before GRPO (:mod:`jaxmoe.rl.sft`).

    Attributes:
      steps: updates, each on ``prompts_per_step x group_size`` demonstrations (0: none).
      learning_rate: the constant rate of their AdamW (clipped at 1, no weight decay).
    """

    steps: int = 0
    learning_rate: float = 1e-3


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO post-training (``jaxmoe rl``).

    Attributes:
      steps: optimizer updates of the run (one rollout batch each, ``updates_per_batch`` updates).
      seed: the prompt order and every sampled token are pure functions of it and the step.
      domains: reward domains (:mod:`jaxmoe.rl.domains`), prompts taken from each in turn.
      prompts_per_step: P prompts a step; each gets ``group_size`` completions.
      group_size: G completions per prompt (advantages are relative to the group).
      max_tokens: most tokens of one completion (thinking, answer and end token).
      temperature, top_p: rollout sampling.
      thinking: the tiers' budgets; each prompt carries a tier.
      epsilon_low, epsilon_high: the clip range ``[1 - low, 1 + high]`` of the ratio.
      beta: weight of the k3 KL to the initial (reference) policy; 0 (default, as TRL): none kept.
      is_cap: sequences whose engine-vs-trainer importance ratio exceeds this are masked out.
      scale_rewards: divide advantages by the group's standard deviation.
      updates_per_batch: optimizer updates on each rollout batch (1: strictly on-policy).
      optim: AdamW of the updates (warm-up, cosine, clipping as in training).
      eval_every: held-out reward every N steps, at step 0 and at the end (0: at 0 and the end).
      eval_prompts: held-out prompts per domain; eval_samples: completions of each.
      log_every, checkpoint_every, keep_checkpoints: as in training.
      cache_bytes: the rollout engine's page and slot pools.
      sft: the cold start: supervised steps on demonstrations of the answer format, taken before
        the first GRPO step of a fresh run (a model pretrained on raw text never closes a thinking
        block or ends a turn, so its groups all score alike and GRPO has nothing to compare).
    """

    steps: int = 40
    seed: int = 0
    domains: tuple[str, ...] = ("code", "tool_args", "budget")
    prompts_per_step: int = 6
    group_size: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    thinking: ThinkingBudgets = ThinkingBudgets()
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    is_cap: float = 2.0
    scale_rewards: bool = True
    updates_per_batch: int = 1
    optim: OptimConfig = OptimConfig(learning_rate=2e-4, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)
    eval_every: int = 20
    eval_prompts: int = 8
    eval_samples: int = 4
    log_every: int = 1
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    cache_bytes: int = 1 << 26
    sft: ColdStart = ColdStart()

    def budget(self, tier: str) -> int:
        return getattr(self.thinking, tier)

    @property
    def budgets(self) -> dict[str, int]:
        """``{tier: thinking budget}``."""
        return {t: self.budget(t) for t in TIERS}


def validate_rl(rl: RLConfig, cfg: Config) -> None:
    """Raises ConfigError naming the ``rl.`` field and what is allowed."""
    from jaxmoe.rl.domains import DOMAINS  # noqa: PLC0415 (domains import the chat stack)

    def need(cond, field, msg):
        if not cond:
            raise ConfigError(f"rl.{field}: {msg}")

    for name in ("steps", "prompts_per_step", "max_tokens", "updates_per_batch", "eval_prompts", "eval_samples"):
        need(getattr(rl, name) >= 1, name, f"must be >= 1, got {getattr(rl, name)}")
    need(rl.group_size >= 2, "group_size", f"must be >= 2 (advantages are relative to the group), got {rl.group_size}")
    need(len(rl.domains) >= 1, "domains", f"name at least one of {sorted(DOMAINS)}")
    for d in rl.domains:
        need(d in DOMAINS, "domains", f"unknown domain {d!r}; allowed: {sorted(DOMAINS)}")
    need(rl.temperature > 0, "temperature", f"must be > 0 (GRPO needs sampled groups), got {rl.temperature}")
    need(0 < rl.top_p <= 1, "top_p", f"must be in (0, 1], got {rl.top_p}")
    budgets = [rl.budget(t) for t in TIERS]
    need(min(budgets) >= 0, "thinking", f"budgets must be >= 0, got {dict(zip(TIERS, budgets))}")
    need(budgets == sorted(budgets), "thinking", f"budgets must not decrease low <= high <= max, got {budgets}")
    need(max(budgets) < rl.max_tokens, "thinking.max", f"must be < max_tokens {rl.max_tokens}, got {max(budgets)}")
    need(0 <= rl.epsilon_low < 1, "epsilon_low", f"must be in [0, 1), got {rl.epsilon_low}")
    need(rl.epsilon_high >= 0, "epsilon_high", f"must be >= 0, got {rl.epsilon_high}")
    need(rl.beta >= 0, "beta", f"must be >= 0, got {rl.beta}")
    need(rl.is_cap > 0, "is_cap", f"must be > 0 (inf: never mask), got {rl.is_cap}")
    for name in ("eval_every", "checkpoint_every"):
        need(getattr(rl, name) >= 0, name, f"must be >= 0, got {getattr(rl, name)}")
    need(rl.log_every >= 1, "log_every", f"must be >= 1, got {rl.log_every}")
    need(rl.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {rl.keep_checkpoints}")
    need(rl.cache_bytes >= 1, "cache_bytes", f"must be >= 1, got {rl.cache_bytes}")
    need(rl.sft.steps >= 0, "sft.steps", f"must be >= 0, got {rl.sft.steps}")
    need(rl.sft.learning_rate > 0, "sft.learning_rate", f"must be > 0, got {rl.sft.learning_rate}")
    need(
        rl.beta == 0 or rl.sft.steps == 0,
        "beta",
        "must be 0 with a cold start (rl.sft.steps > 0): the KL reference is the --init weights, not the "
        "fine-tuned ones",
    )
    batch = rl.prompts_per_step * rl.group_size
    spec = logical_to_spec(("batch",))[0]
    axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
    shards = math.prod(getattr(cfg.mesh, a) for a in axes)
    need(
        batch % shards == 0,
        "prompts_per_step",
        f"prompts_per_step x group_size = {batch} must divide over the batch axis's {shards} shards "
        f"(mesh axes {', '.join(axes)})",
    )
    if cfg.model.moe is not None and cfg.model.moe.dispatch not in ("dropless", "dense"):
        raise ConfigError(
            f"model.moe.dispatch: the rollout engine and the trainer must route the same way (dropless or dense), "
            f"got {cfg.model.moe.dispatch!r}"
        )


def load_rl_config(path: str, overrides: Sequence[tuple[str, str]] = ()) -> tuple[Config, RLConfig]:
    """The training config and the RL section of the config file ``path`` (``FILE`` or ``FILE:ARG``)."""
    d: dict[str, Any] = _to_plain(load_config_dict(path))
    if "rl" not in d:
        raise ConfigError(f"config {path!r} has no 'rl' section (e.g. configs/tiny.py:rl)")
    rl = d.pop("rl")
    if not isinstance(rl, dict):
        raise ConfigError(f"config field rl must be a mapping of RL fields, got {rl!r}")
    rl_overrides = [o for o in overrides if o[0] == "rl" or o[0].startswith("rl.")]
    rest = [o for o in overrides if o not in rl_overrides]
    cfg = from_config_dict(apply_overrides(d, rest))
    values = section_overrides(rl, rl_overrides, RLConfig())
    if isinstance(values.get("optim"), dict):  # a partial section keeps RLConfig's optimizer defaults
        values["optim"] = {**dataclasses.asdict(RLConfig().optim), **values["optim"]}
    if isinstance(values.get("domains"), str):
        values["domains"] = tuple(v.strip() for v in values["domains"].split(",") if v.strip())
    elif "domains" in values:
        values["domains"] = tuple(values["domains"])
    rl_cfg = _build(RLConfig, values, "rl.")
    validate_rl(rl_cfg, cfg)
    return cfg, rl_cfg
