"""The RL cold start: supervised steps on the domains' demonstrations before GRPO (``rl.sft``).

Each step renders ``prompts_per_step x group_size`` training prompts exactly as the rollouts do
(:func:`jaxmoe.chat.template.render`, the tier's thinking block open) and appends the
demonstration turn the engine would have to sample: the end of thinking (an empty block), the
answer (:func:`jaxmoe.rl.demos.demonstration`) and the end-of-turn token. The loss is the mean
negative log-likelihood of those appended tokens; the prompt is context only. The update runs on
the training mesh with the trainer's shardings, with its own constant-rate AdamW, and leaves the
GRPO optimizer state untouched.

Shape letters: B sequences, T positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxmoe.chat.decoding import MarkupIds
from jaxmoe.config import OptimConfig
from jaxmoe.rl.demos import demonstration
from jaxmoe.rl.domains import Prompt
from jaxmoe.rl.rollout import pack, render_prompt
from jaxmoe.train.optim import model_optimizer
from jaxmoe.train.step import set_dense_dsa


class SFTBatch(NamedTuple):
    inputs: np.ndarray  # [B, T] int32
    targets: np.ndarray  # [B, T] int32
    mask: np.ndarray  # [B, T] float32: 1 where the target is a demonstration token


def demonstration_ids(prompt: Prompt, tokenizer, budget: int, ids: MarkupIds) -> tuple[list[int], list[int]]:
    """``(prompt ids, demonstration ids)`` of one prompt under its tier's thinking ``budget``."""
    prompt_ids, thinking = render_prompt(prompt, tokenizer, budget, ids)
    turn = [ids.think_close] if thinking else []
    turn += tokenizer.encode(demonstration(prompt))
    turn.append(ids.end if ids.end is not None else ids.eos)
    return prompt_ids, turn


def sft_batch(prompts: Sequence[Prompt], tokenizer, budgets: dict[str, int], max_tokens: int) -> SFTBatch:
    """The demonstrations of ``prompts`` packed into ``[B, T]`` arrays (T rounded up to a multiple).

    A demonstration longer than ``max_tokens`` is cut there, as a rollout would be.
    """
    ids = MarkupIds.from_tokenizer(tokenizer)
    pairs = []
    for p in prompts:
        prompt_ids, turn = demonstration_ids(p, tokenizer, budgets[p.tier], ids)
        pairs.append((prompt_ids, turn[:max_tokens]))
    tokens, mask = pack(pairs)
    return SFTBatch(tokens[:, :-1], tokens[:, 1:], mask)


def sft_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """Clipped AdamW at a constant rate, no weight decay."""
    return model_optimizer(
        OptimConfig(learning_rate=learning_rate, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0), 1
    )


def nll(graphdef, params: dict, router_bias: dict, batch: SFTBatch) -> jax.Array:
    """Mean negative log-likelihood of the masked targets (fp32 scalar)."""
    model = nnx.merge(graphdef, params, router_bias)
    set_dense_dsa(model, False)
    logz = jax.nn.log_softmax(model(batch.inputs).astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logz, batch.targets[..., None], axis=-1)[..., 0]
    return -(logp * batch.mask).sum() / jnp.maximum(batch.mask.sum(), 1.0)


def sft_step(graphdef, learning_rate: float, params: dict, router_bias: dict, opt_state, batch: SFTBatch):
    """One update: ``(params, opt_state, loss before the update)``."""
    loss, grads = jax.value_and_grad(nll, argnums=1)(graphdef, params, router_bias, batch)
    updates, opt_state = sft_optimizer(learning_rate).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
