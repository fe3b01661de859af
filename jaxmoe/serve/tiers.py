"""Thinking tiers: their budgets, how a request picks one, and the per-tier admission gate.

A tier (``low``, ``high``, ``max``) is a thinking budget in tokens (``--thinking-budgets``, defaults
in :data:`DEFAULT_BUDGETS`) and a set of running slots with a waiting queue of its own
(``--tier-slots``, ``--max-queue``), so deep Max requests never hold up Low ones.

A request picks its tier by OpenAI ``reasoning_effort`` (:func:`tier_for_effort`), by Anthropic
``thinking.budget_tokens`` (:func:`tier_for_budget`), or, naming neither, by auto routing
(:func:`route`). Auto routing applies the first of these rules that holds (most specific first):

1. ``terminal-tool`` -> max: a tool offered whose name or description contains (any case)
   one of :data:`TERMINAL_WORDS`: shell, bash, terminal, command, exec.
2. ``tool-results`` -> max: tools are offered and the history already holds a tool result (a
   message of role ``tool``): a multi-turn retrieval loop.
3. Multi-step reasoning -> high, the first that holds of:
   ``tools-offered``: any tool is offered;
   ``reasoning-cue``: the last user message holds a cue of :data:`REASONING_CUES` at a word's
   start (any case): "step by step", prove, derive, why, plan, debug, analy(se/ze/sis),
   calculate, compare (and their inflections);
   ``long-prompt``: the last user message is over :data:`LONG_PROMPT_CHARS` (600) characters;
   ``many-questions``: it holds 3 or more questions (runs of ``?``).
4. ``simple`` -> low: anything else (simple Q&A).

Messages are the internal dicts (``role``; ``content`` a string, None, or a list of parts of which
``{"type": "text", "text": ...}`` ones count); tools are ``{"name", "description", ...}`` dicts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from jaxmoe.serve.metrics import Metrics

TIERS = ("low", "high", "max")
# Thinking tokens per tier. Low answers after a short look; Max fits a long agentic step.
DEFAULT_BUDGETS = {"low": 512, "high": 4096, "max": 32768}
# Running slots per tier: requests of the tier the engine runs at once.
DEFAULT_SLOTS = {"low": 4, "high": 2, "max": 2}
_FLAGS = {"--thinking-budgets": (0, DEFAULT_BUDGETS), "--tier-slots": (1, DEFAULT_SLOTS)}

# reasoning_effort -> (tier, thinking on).
EFFORTS = {
    "none": ("low", False),
    "minimal": ("low", True),
    "low": ("low", True),
    "medium": ("high", True),
    "high": ("high", True),
    "xhigh": ("max", True),
    "max": ("max", True),
}

TERMINAL_WORDS = ("shell", "bash", "terminal", "command", "exec")
REASONING_CUES = (
    r"step[\s-]+by[\s-]+step",
    r"prov(e|es|ed|en|ing)\b",
    r"deriv",
    r"why\b",
    r"plan(s|ned|ning)?\b",
    r"debug",
    r"analy[sz]",
    r"calculat",
    r"compar(e|es|ed|ing|ison)\b",
)
_CUE_RE = re.compile(r"\b(" + "|".join(REASONING_CUES) + ")", re.IGNORECASE)
LONG_PROMPT_CHARS = 600
MANY_QUESTIONS = 3


def parse_tier_values(text: str | None, what: str, defaults: Mapping[str, int] | None = None) -> dict[str, int]:
    """Parses ``low=N,high=N,max=N`` (``--thinking-budgets`` or ``--tier-slots``).

    Args:
        text: the flag's value; tiers it leaves out (all of them when empty or None) keep their
            defaults.
        what: the flag, ``"--thinking-budgets"`` (values >= 0, non-decreasing low <= high <= max)
            or ``"--tier-slots"`` (values >= 1).
        defaults: the values of tiers not given; the flag's defaults (:data:`DEFAULT_BUDGETS`,
            :data:`DEFAULT_SLOTS`) when None.

    Returns:
        ``{tier: value}`` for every tier of :data:`TIERS`, in that order.

    Raises:
        ValueError: naming the flag, the tier and what is allowed.
    """
    if what not in _FLAGS:
        raise ValueError(f"what: one of {sorted(_FLAGS)}, got {what!r}")
    minimum, flag_defaults = _FLAGS[what]
    values = dict(flag_defaults if defaults is None else defaults)
    seen = set()
    for item in (text or "").split(","):
        if not item.strip():
            continue
        tier, eq, value = (s.strip() for s in item.partition("="))
        if not eq or tier not in TIERS:
            raise ValueError(f"{what}: {item.strip()!r} is not TIER=N with TIER one of {', '.join(TIERS)}")
        if tier in seen:
            raise ValueError(f"{what}: tier {tier!r} is given twice")
        seen.add(tier)
        if not re.fullmatch(r"[0-9]+", value) or int(value) < minimum:
            raise ValueError(f"{what}: {tier}={value!r} is not an integer >= {minimum}")
        values[tier] = int(value)
    if what == "--thinking-budgets":
        for lo, hi in zip(TIERS, TIERS[1:]):
            if values[lo] > values[hi]:
                raise ValueError(
                    f"{what}: budgets must not decrease from low to high to max, "
                    f"got {lo}={values[lo]} > {hi}={values[hi]}"
                )
    return {t: values[t] for t in TIERS}


def tier_for_effort(effort: str) -> tuple[str, bool]:
    """The tier of an OpenAI ``reasoning_effort`` value, and whether the model thinks at all.

    ``none`` is Low without thinking; ``minimal`` and ``low`` are Low, ``medium`` and ``high`` High,
    ``xhigh`` and ``max`` Max.

    Raises:
        ValueError: ``reasoning_effort`` is none of those values.
    """
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise ValueError(f"reasoning_effort: one of {', '.join(EFFORTS)}, got {effort!r}")
    return EFFORTS[effort]


def tier_for_budget(budget_tokens: int, budgets: Mapping[str, int] = DEFAULT_BUDGETS) -> tuple[str, int]:
    """The tier of an Anthropic ``thinking.budget_tokens`` N, and how many tokens it may think.

    Args:
        budget_tokens: N, an integer >= 1.
        budgets: ``{tier: thinking budget}``, non-decreasing in :data:`TIERS` order.

    Returns:
        The smallest tier whose budget is >= N (max if none is), and min(N, that tier's budget).

    Raises:
        ValueError: N is not an integer >= 1.
    """
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
        raise ValueError(f"thinking.budget_tokens: an integer >= 1, got {budget_tokens!r}")
    tier = next((t for t in TIERS if budgets[t] >= budget_tokens), TIERS[-1])
    return tier, min(budget_tokens, budgets[tier])


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _tool_words(tool: Mapping) -> str:
    tool = tool.get("function", tool)  # an OpenAI {"type": "function", "function": {...}} too
    return f"{tool.get('name') or ''} {tool.get('description') or ''}".lower()


def route(messages: Sequence[Mapping], tools: Sequence[Mapping] | None) -> tuple[str, str]:
    """Auto routing: the tier of a request that names no effort, by the module docstring's rules.

    Args:
        messages: the conversation, internal message dicts.
        tools: the tools offered (None or empty: none).

    Returns:
        ``(tier, rule)``, the rule's short name (``terminal-tool``, ``tool-results``,
        ``tools-offered``, ``reasoning-cue``, ``long-prompt``, ``many-questions`` or ``simple``).
    """
    tools = tools or ()
    if any(w in _tool_words(t) for t in tools for w in TERMINAL_WORDS):
        return "max", "terminal-tool"
    if tools and any(m.get("role") == "tool" for m in messages):
        return "max", "tool-results"
    if tools:
        return "high", "tools-offered"
    last = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    if _CUE_RE.search(last):
        return "high", "reasoning-cue"
    if len(last) > LONG_PROMPT_CHARS:
        return "high", "long-prompt"
    if len(re.findall(r"\?+", last)) >= MANY_QUESTIONS:
        return "high", "many-questions"
    return "low", "simple"


class QueueFull(Exception):
    """A tier's slots are all busy and its queue is full: answer 429 with ``Retry-After``.

    Attributes:
        tier: the tier refused.
        retry_after: seconds (an integer >= 1) after which a slot is likely free.
    """

    def __init__(self, tier: str, retry_after: int):
        super().__init__(f"tier {tier!r}: every slot is busy and the queue is full; retry after {retry_after} s")
        self.tier = tier
        self.retry_after = retry_after


class _Tier:
    """One tier's admission state: slots in use, waiters in arrival order, recent service times."""

    def __init__(self, slots: int, default_service_s: float):
        self.slots = slots
        self.running = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.default_service_s = default_service_s
        self.service_s: collections.deque[float] = collections.deque(maxlen=32)

    def live_waiters(self) -> int:
        # A waiter cancelled but not yet resumed still sits in the deque; it holds no place.
        return sum(not f.done() for f in self.waiters)


class TierGate:
    """Per-tier admission for an asyncio server: each tier has its own slots and FIFO queue.

    ``async with gate.slot(tier):`` runs the body holding one of the tier's slots, waiting for
    one in arrival order when all are busy; with ``max_queue`` requests of the tier already
    waiting it raises :class:`QueueFull` at once. A freed slot passes straight to the tier's
    oldest waiter, so a newcomer never overtakes the queue. A waiter cancelled (its client gone,
    a timeout) leaves the queue and, if a slot had just been handed to it, passes the slot on.
    One event loop only: the gate is not thread-safe.

    Args:
        slots: ``{tier: running slots}``, each >= 1 (see :func:`parse_tier_values`).
        max_queue: requests of one tier that may wait (>= 0; 0: refuse when the slots are busy).
        metrics: whose ``jaxmoe_queue_depth`` and ``jaxmoe_requests_running`` the gate keeps
            current, or None.
        default_service_s: the service time assumed for ``Retry-After`` until requests finish.
    """

    def __init__(
        self,
        slots: Mapping[str, int],
        max_queue: int,
        metrics: Metrics | None = None,
        *,
        default_service_s: float = 5.0,
    ):
        for tier, n in slots.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"slots[{tier!r}]: an integer >= 1, got {n!r}")
        if not slots:
            raise ValueError("slots: at least one tier")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue: an integer >= 0, got {max_queue!r}")
        self.max_queue = max_queue
        self._metrics = metrics
        self._tiers = {t: _Tier(n, default_service_s) for t, n in slots.items()}
        for tier in self._tiers:
            self._publish(tier)

    def _get(self, tier: str) -> _Tier:
        if tier not in self._tiers:
            raise ValueError(f"tier: one of {', '.join(self._tiers)}, got {tier!r}")
        return self._tiers[tier]

    def depth(self, tier: str) -> int:
        """Requests of the tier waiting for a slot."""
        return self._get(tier).live_waiters()

    def running(self, tier: str) -> int:
        """Requests holding one of the tier's slots."""
        return self._get(tier).running

    def retry_after(self, tier: str) -> int:
        """Seconds until a newcomer to the tier's queue would likely get a slot (>= 1).

        The mean of the tier's recent service times, times the newcomer's place in the queue, over
        the tier's slots.
        """
        t = self._get(tier)
        mean = sum(t.service_s) / len(t.service_s) if t.service_s else t.default_service_s
        return max(1, math.ceil(mean * (t.live_waiters() + 1) / t.slots))

    def _publish(self, tier: str) -> None:
        if self._metrics is not None:
            t = self._tiers[tier]
            self._metrics.queue_depth.labels(tier).set(t.live_waiters())
            self._metrics.requests_running.labels(tier).set(t.running)

    async def _acquire(self, tier: str) -> None:
        t = self._get(tier)
        while t.waiters and t.waiters[0].done():
            t.waiters.popleft()
        if t.running < t.slots and not t.live_waiters():
            t.running += 1
            self._publish(tier)
            return
        if t.live_waiters() >= self.max_queue:
            raise QueueFull(tier, self.retry_after(tier))
        waiter = asyncio.get_running_loop().create_future()
        t.waiters.append(waiter)
        self._publish(tier)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(tier)  # the slot was handed over just before the cancellation
            else:
                with contextlib.suppress(ValueError):
                    t.waiters.remove(waiter)
                self._publish(tier)
            raise

    def _release(self, tier: str) -> None:
        t = self._tiers[tier]
        while t.waiters:
            waiter = t.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: running stays the same
                break
        else:
            t.running -= 1
        self._publish(tier)

    @contextlib.asynccontextmanager
    async def slot(self, tier: str) -> AsyncIterator[None]:
        """Holds one of the tier's running slots for the body of ``async with``.

        Raises:
            QueueFull: the tier's slots are busy and ``max_queue`` requests already wait.
            ValueError: an unknown tier.
        """
        await self._acquire(tier)
        start = time.monotonic()
        try:
            yield
        finally:
            self._tiers[tier].service_s.append(time.monotonic() - start)
            self._release(tier)


__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_SLOTS",
    "EFFORTS",
    "QueueFull",
    "TIERS",
    "TierGate",
    "parse_tier_values",
    "route",
    "tier_for_budget",
    "tier_for_effort",
]
