"""Rollouts through the inference engine, and the training batch they make.

Each prompt is a chat turn rendered as in serving (:func:`jaxmoe.chat.template.render`, the
thinking block open when the tier's budget is above 0) and decoded under the same constraint as
a served request (:class:`jaxmoe.chat.decoding.ChatDecoding` with the tier's thinking budget: the
engine forces the end of thinking when it is spent). The engine samples from the *masked*
distribution (tokens the constraint forbids removed), so every sampled token's allowed set is
recorded with it; the trainer recomputes log-probabilities under the same sets, which is what
makes the engine's and the trainer's log-probabilities of one token the same number.

Shape letters: B rollouts, T positions (prompt + completion, padded), V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxmoe.chat import parser as chat_parser
from jaxmoe.chat.decoding import ChatDecoding, MarkupIds
from jaxmoe.chat.template import render
from jaxmoe.inference.engine import Engine
from jaxmoe.inference.sampler import SamplingParams
from jaxmoe.inference.scheduler import Request
from jaxmoe.rl.domains import DOMAINS, Prompt, answer_from

POSITION_MULTIPLE = 64  # T of a training batch is padded to a multiple (few shapes to compile; context shards)


class _Recorded:
    """A constraint that remembers the allowed set of every token it was asked about (bit-packed)."""

    def __init__(self, inner: ChatDecoding):
        self.inner = inner
        self.masks: list[np.ndarray | None] = []
        self._pending: np.ndarray | None = None

    def allowed(self):
        mask = self.inner.allowed()
        self._pending = None if mask is None else np.packbits(mask)
        return mask

    def accept(self, token: int) -> None:
        self.masks.append(self._pending)
        self._pending = None
        self.inner.accept(token)


@dataclasses.dataclass
class Rollout:
    """One sampled completion of one prompt."""

    prompt: Prompt
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # the engine's, of each output token under the masked distribution
    masks: list[np.ndarray | None]  # each output token's allowed set, np.packbits of [V] (None: all)
    finish_reason: str
    reasoning_tokens: int
    reward: float


def render_prompt(prompt: Prompt, tokenizer, budget: int, ids: MarkupIds) -> tuple[list[int], bool]:
    """``(prompt ids, thinking)``: the prompt as served (thinking open when ``budget > 0``), and
    whether the completion starts inside a thinking block."""
    prompt_ids = render(list(prompt.messages), tokenizer, thinking=budget > 0)
    return prompt_ids, budget > 0 and ids.think_open is not None and prompt_ids[-1] == ids.think_open


def pack(turns: Sequence[tuple[list[int], list[int]]], multiple: int = POSITION_MULTIPLE):
    """``(prompt ids, completion ids)`` pairs as ``tokens [B, T + 1]`` and ``mask [B, T]``.

    T is the longest prompt + completion less one, rounded up to ``multiple``; ``mask`` is 1 at the
    positions whose next token (``tokens[:, 1:]``) is a completion token.
    """
    longest = max(len(a) + len(b) for a, b in turns) - 1
    T = -(-longest // multiple) * multiple
    tokens = np.zeros((len(turns), T + 1), np.int32)
    mask = np.zeros((len(turns), T), np.float32)
    for b, (prompt_ids, output_ids) in enumerate(turns):
        seq = [*prompt_ids, *output_ids]
        tokens[b, : len(seq)] = seq
        mask[b, len(prompt_ids) - 1 : len(seq) - 1] = 1.0
    return tokens, mask


def rollout(
    engine: Engine,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    samples: int,
    seeds: Sequence[int],
    budgets: dict[str, int],
    max_tokens: int,
    temperature: float,
    top_p: float,
) -> list[Rollout]:
    """``samples`` completions of every prompt (a prompt's completions together), scored.

    Args:
      engine: the engine over the current weights (process 0 of a multi-process run; the others
        run ``engine.follow()`` meanwhile).
      tokenizer: the model's :class:`jaxmoe.chat.tokenizer.Tokenizer`.
      prompts: the prompts; ``seeds[i]`` seeds the sampling of the ``i``-th completion overall.
      budgets: ``{tier: thinking budget}``.
    """
    ids = MarkupIds.from_tokenizer(tokenizer)
    vocab = engine.cfg.vocab_size
    jobs = []
    for p in prompts:
        budget = budgets[p.tier]
        prompt_ids, thinking = render_prompt(p, tokenizer, budget, ids)
        for _ in range(samples):
            decoding = ChatDecoding(
                tokenizer,
                vocab_size=vocab,
                max_tokens=max_tokens,
                thinking_budget=budget if thinking else None,
                ids=ids,
            )
            jobs.append((p, prompt_ids, thinking, budget, _Recorded(decoding)))
    if len(seeds) != len(jobs):
        raise ValueError(f"seeds: need one per completion ({len(jobs)}), got {len(seeds)}")
    requests = [
        Request(
            tuple(prompt_ids),
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=int(seed)),
            stop_ids=ids.end_ids,
            constraint=recorder,
            tenant="rl",
        )
        for (_, prompt_ids, _, _, recorder), seed in zip(jobs, seeds, strict=True)
    ]
    completions = engine.generate(requests)
    out = []
    for (p, prompt_ids, thinking, budget, recorder), c in zip(jobs, completions, strict=True):
        parsed = chat_parser.parse(c.output_ids, tokenizer, thinking=thinking)
        answer = answer_from(parsed, thinking_budget=budget, finished=c.finish_reason == "stop")
        reward = float(DOMAINS[p.domain].reward(p.data, answer))
        out.append(
            Rollout(
                p,
                list(prompt_ids),
                list(c.output_ids),
                list(c.logprobs),
                list(recorder.masks),
                c.finish_reason,
                parsed.reasoning_tokens,
                reward,
            )
        )
    return out


@dataclasses.dataclass
class HostBatch:
    """A rollout batch as host arrays (what every process of a run turns into global arrays)."""

    inputs: np.ndarray  # [B, T] int32: prompt + completion, shifted (position t predicts targets[t])
    targets: np.ndarray  # [B, T] int32
    allowed: np.ndarray  # [B, T, V] bool: each target's allowed set (all True off the completion)
    mask: np.ndarray  # [B, T] float32: 1 where the target is a completion token
    engine_logp: np.ndarray  # [B, T] float32: the engine's log-probability of each completion target

    @property
    def completion_tokens(self) -> int:
        return int(self.mask.sum())


def host_batch(rollouts: Sequence[Rollout], vocab_size: int, multiple: int = POSITION_MULTIPLE) -> HostBatch:
    """Packs rollouts into ``[B, T]`` arrays, T the longest prompt + completion less one, rounded up."""
    tokens, mask = pack([(r.prompt_ids, r.output_ids) for r in rollouts], multiple)
    B, T = mask.shape
    allowed = np.ones((B, T, vocab_size), bool)
    engine_logp = np.zeros((B, T), np.float32)
    for b, r in enumerate(rollouts):
        first = len(r.prompt_ids) - 1  # the position whose target is the first output token
        engine_logp[b, first : first + len(r.output_ids)] = r.logprobs
        for j, packed in enumerate(r.masks):
            if packed is not None:
                allowed[b, first + j] = np.unpackbits(packed, count=vocab_size).astype(bool)
    return HostBatch(tokens[:, :-1], tokens[:, 1:], allowed, mask, engine_logp)


def group_stats(rollouts: Sequence[Rollout], group_size: int) -> dict:
    """Per-domain reward mean and std, the share of groups whose rewards are all equal, lengths."""
    rewards = np.array([r.reward for r in rollouts], np.float64)
    domains = sorted({r.prompt.domain for r in rollouts})
    by = {d: rewards[[r.prompt.domain == d for r in rollouts]] for d in domains}
    groups = rewards.reshape(-1, group_size)
    lengths = np.array([len(r.output_ids) for r in rollouts])
    return {
        "reward": {d: float(v.mean()) for d, v in by.items()},
        "reward_std": {d: float(v.std()) for d, v in by.items()},
        "reward_mean": float(rewards.mean()),
        "zero_variance_groups": float(np.mean(groups.max(axis=1) == groups.min(axis=1))),
        "completion_tokens_mean": float(lengths.mean()),
        "completion_tokens_max": int(lengths.max()),
        "reasoning_tokens_mean": float(np.mean([r.reasoning_tokens for r in rollouts])),
        "truncated_fraction": float(np.mean([r.finish_reason == "length" for r in rollouts])),
    }
