"""What both APIs share: a request becomes a job (tier, prompt, constraint), a job runs as events.

A route turns its API's body into internal messages and options, then :meth:`Service.chat_job`
renders the prompt, picks the tier and builds the decoding constraint (thinking budget, tool calls,
JSON schema); :meth:`Service.admit` takes one of the tier's running slots (or refuses at once with
429 when its queue is full); :meth:`Service.events` runs the job on the engine and yields
:class:`Event` s (reasoning, content, tool-call starts, argument fragments) and a final
:class:`Outcome`. The routes only translate those into their API's responses and stream chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np

from jaxmoe.chat import parser as chat_parser
from jaxmoe.chat.decoding import ChatDecoding, MarkupIds
from jaxmoe.chat.format import markup_for
from jaxmoe.chat.template import render
from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.config import VisionConfig
from jaxmoe.inference.sampler import SamplingParams
from jaxmoe.inference.scheduler import Request
from jaxmoe.serve import params
from jaxmoe.serve.auth import KeyChecker
from jaxmoe.serve.errors import APIError, bad_request
from jaxmoe.serve.images import prepare as prepare_images
from jaxmoe.serve.metrics import Metrics
from jaxmoe.serve.runner import EngineRunner
from jaxmoe.serve.tiers import TIERS, QueueFull, TierGate
from jaxmoe.vision.preprocess import ImageLimits


@dataclasses.dataclass(frozen=True)
class Event:
    """A piece of the answer: ``kind`` is reasoning, content, tool_call (``index, name, id``) or arguments."""

    kind: str
    text: str = ""
    index: int | None = None
    name: str | None = None
    id: str | None = None


@dataclasses.dataclass
class Outcome:
    """How a job ended, and its token counts."""

    finish: str  # "stop", "length", "tool_calls", "stop_sequence"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cached_tokens: int
    text: str | None = None  # plain completions: the engine's text
    image_tokens: int = 0  # prompt tokens that are image placeholders (in prompt_tokens)


@dataclasses.dataclass
class Job:
    tier: str
    rule: str
    prompt_ids: list[int]
    request: Request
    thinking: bool
    decoding: ChatDecoding | None  # None: a plain completion (no chat constraint, no parsing)
    stop: tuple[str, ...] = ()
    call_prefix: str = "call_"  # tool-call ids: OpenAI call_..., Anthropic toolu_...
    image_tokens: int = 0


class _SingleCall:
    """Wraps a chat constraint so that the turn ends after its first tool call (no parallel calls)."""

    def __init__(self, inner: ChatDecoding, ids: MarkupIds):
        self.inner, self.ids, self.closed = inner, ids, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def allowed(self):
        mask = self.inner.allowed()
        if self.closed:
            only_end = np.zeros_like(mask)
            only_end[list(self.ids.end_ids)] = True
            return mask & only_end if (mask & only_end).any() else mask
        return mask

    def accept(self, token: int) -> None:
        self.inner.accept(token)
        self.closed = self.closed or token == self.ids.call_close


class _StopStrings:
    """Cuts content at the first stop string; holds back a tail that could still start one."""

    def __init__(self, stop: Sequence[str]):
        self.stop, self.text, self.released = tuple(stop), "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, text: str) -> tuple[str, str | None]:
        """Content to release now, and the stop string that ended it (None: not ended)."""
        self.text += text
        hits = [(self.text.find(s), s) for s in self.stop if s in self.text]
        if hits:
            at, s = min(hits)
            out, self.released = self.text[self.released : at], at
            return out, s
        safe = max(self.released, len(self.text) - self.hold)
        out, self.released = self.text[self.released : safe], safe
        return out, None

    def flush(self) -> str:
        out, self.released = self.text[self.released :], len(self.text)
        return out


_NO_STOPS = _StopStrings(())


class Service:
    """The model behind the routes: tokenizer, engine runner, tiers, auth, metrics."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        runner: EngineRunner,
        gate: TierGate,
        metrics: Metrics,
        checker: KeyChecker,
        model_name: str,
        budgets: dict[str, int],
        max_context: int,
        vocab_size: int,
        request_timeout: float | None,
        vision: VisionConfig | None = None,
        image_limits: ImageLimits | None = None,
    ):
        self.tokenizer, self.runner, self.gate, self.metrics, self.checker = tokenizer, runner, gate, metrics, checker
        self.model_name, self.budgets, self.max_context = model_name, budgets, max_context
        self.vocab_size, self.request_timeout = vocab_size, request_timeout
        self.vision, self.image_limits = vision, image_limits or ImageLimits()
        self.markup = markup_for(tokenizer)
        self.ids = MarkupIds.from_tokenizer(tokenizer, self.markup)
        self.created = int(time.time())
        self.engine_limit = min(max_context, runner.engine.scheduler.pages.capacity * runner.engine.config.page_size)

    # ------------------------------------------------------------------------------------
    # Jobs

    def check_model(self, model) -> None:
        if not isinstance(model, str) or not model:
            raise bad_request("model: required, a string (GET /v1/models lists it)", "model")
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model")

    def max_tokens(self, value, prompt_len: int, field: str) -> int:
        """The request's max_tokens (default: the rest of the context), checked against the context."""
        limit = self.engine_limit
        if prompt_len >= limit:
            raise bad_request(
                f"the prompt is {prompt_len} tokens; this model's context is {limit} tokens, and the answer needs "
                "at least one more",
                "messages",
            )
        if value is None:
            return limit - prompt_len
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_request(f"{field}: must be an integer >= 1, got {value!r}", field)
        if prompt_len + value > limit:
            raise bad_request(
                f"the prompt ({prompt_len} tokens) plus {field} ({value}) is {prompt_len + value} tokens; this "
                f"model's context is {limit} tokens",
                field,
            )
        return value

    def chat_job(
        self,
        *,
        messages: list[dict],
        tools: list[dict],
        tool_choice,
        response_schema: dict | None,
        tier: str,
        rule: str,
        thinking_budget: int | None,
        max_tokens,
        max_tokens_field: str,
        sampling: SamplingParams,
        stop: tuple[str, ...],
        tenant: str,
        parallel_calls: bool = True,
        min_tokens=None,
    ) -> Job:
        """Renders the prompt and builds the constraint; raises :class:`APIError` 400 naming the field.

        User messages may hold :class:`~jaxmoe.serve.images.ImagePart` s in their content lists;
        they are decoded and preprocessed here, and go to the engine with the request.

        ``min_tokens`` (vLLM's extension): the answer's first N tokens never end it (the grammar may
        still end it where nothing else is allowed, e.g. after a complete forced tool call).
        """
        messages, images, image_tokens = prepare_images(messages, self.vision, self.image_limits)
        prompt = self._render(messages, tools, bool(thinking_budget))
        # The answer starts in thinking when the prompt opened it (a template may not have).
        thinking = bool(thinking_budget) and self.ids.think_open is not None and prompt[-1] == self.ids.think_open
        limit = self.max_tokens(max_tokens, len(prompt), max_tokens_field)
        min_tokens = params.min_tokens(min_tokens, limit, max_tokens_field)
        try:
            decoding = ChatDecoding(
                self.tokenizer,
                vocab_size=self.vocab_size,
                max_tokens=limit,
                thinking_budget=thinking_budget if thinking else None,
                tools=tools,
                tool_choice=tool_choice,
                response_schema=response_schema,
                ids=self.ids,
            )
        except ValueError as e:
            raise bad_request(str(e), "tools" if tools else "response_format") from e
        constraint = decoding if parallel_calls else _SingleCall(decoding, self.ids)
        request = Request(
            tuple(prompt),
            max_tokens=limit,
            sampling=sampling,
            stop_ids=self.ids.end_ids,
            constraint=constraint,
            tenant=tenant,
            priority=TIERS.index(tier),
            min_tokens=min_tokens,
            images=images,
        )
        return Job(tier, rule, prompt, request, thinking, decoding, tuple(stop), image_tokens=image_tokens)

    def count_tokens(self, messages: list[dict], tools: list[dict], thinking: bool) -> int:
        messages, _, _ = prepare_images(messages, self.vision, self.image_limits)
        return len(self._render(messages, tools, thinking))

    def _render(self, messages: list[dict], tools: list[dict], thinking: bool) -> list[int]:
        image_token_id = self.vision.image_token_id if self.vision is not None else None
        try:
            return render(
                messages, self.tokenizer, tools=tools or None, thinking=thinking, image_token_id=image_token_id
            )
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    # ------------------------------------------------------------------------------------
    # Running

    async def warm_up(self) -> None:
        """One short generation before the first request (compiles the smallest prefill and decode steps)."""
        request = Request((self.tokenizer.eos_id,) * 4, max_tokens=2, ignore_eos=True)
        async for _ in self.runner.generate(request):
            pass

    @contextlib.asynccontextmanager
    async def admit(self, tier: str):
        """One of ``tier``'s running slots for the block; 429 with Retry-After when its queue is full."""
        try:
            async with self.gate.slot(tier):
                yield
        except QueueFull as e:
            self.metrics.requests_total.labels(tier=tier, status="429").inc()
            raise APIError(
                429,
                f"the {tier} tier is full (its running slots busy, {self.gate.depth(tier)} requests waiting); "
                f"retry after {e.retry_after} s",
                headers={"Retry-After": str(e.retry_after), "x-jaxmoe-tier": tier},
            ) from e

    async def events(self, job: Job, call_prefix: str = "call_") -> AsyncIterator[Event | Outcome]:
        """Runs ``job``; yields its events, then one :class:`Outcome`. Closing early cancels it."""
        start = time.monotonic()
        parser = chat_parser.OutputParser(self.tokenizer, self.markup, job.thinking) if job.decoding else None
        text = _PlainText(self.tokenizer) if parser is None else None
        stops = _StopStrings(job.stop)
        run = _Run()
        status = "500"
        try:
            async with contextlib.aclosing(self.runner.generate(job.request)) as updates:
                async for update in updates:
                    if not run.tokens and update.tokens:
                        self.metrics.time_to_first_token.observe(time.monotonic() - start)
                    run.tokens += len(update.tokens)
                    run.completion = update.completion
                    self.metrics.generated_tokens.inc(len(update.tokens))
                    if parser is None:
                        deltas = [chat_parser.Delta("content", text.add(update.tokens, update.completion))]
                    else:
                        deltas = [d for t in update.tokens for d in parser.feed(t)]
                    checks = run.tokens >= job.request.min_tokens  # stop strings wait for min_tokens
                    for event in self._events(deltas, stops if checks else _NO_STOPS, run, call_prefix):
                        yield event
                    if run.stopped is not None:
                        break
            if parser is not None and run.stopped is None:
                for event in self._events(parser.finish(), stops, run, call_prefix):
                    yield event
            if run.stopped is None and (tail := stops.flush()):
                yield Event("content", text=tail)
            status = "200"
            yield self._outcome(job, run, parser)
        except (asyncio.CancelledError, GeneratorExit):  # client gone, or timed out
            status = "cancelled"
            raise
        finally:
            self.metrics.request_done(job.tier, status, time.monotonic() - start)

    def _events(self, deltas, stops: _StopStrings, run: _Run, call_prefix: str):
        for delta in deltas:
            if run.stopped is not None:
                return
            if delta.kind == "tool_call":
                run.calls += 1
                yield Event("tool_call", index=delta.index, name=delta.name, id=call_prefix + secrets.token_hex(12))
            elif delta.kind == "content" and stops.stop:
                released, run.stopped = stops.feed(delta.text)
                if released:
                    yield Event("content", text=released)
            elif delta.text:
                yield Event(delta.kind, text=delta.text, index=delta.index)

    def _outcome(self, job: Job, run: _Run, parser) -> Outcome:
        completion = run.completion
        cached = completion.cached_tokens if completion is not None else 0
        if run.stopped is not None:  # cut by a stop string (the engine request may still have been running)
            finish = "stop_sequence"
        elif completion.finish_reason == "length":
            finish = "length"
        else:
            finish = "tool_calls" if run.calls else "stop"
        self.metrics.prefix_cache_hit_tokens.inc(cached)
        reasoning = parser.reasoning_tokens if parser is not None else 0
        return Outcome(
            finish, run.stopped, len(job.prompt_ids), run.tokens, reasoning, cached, image_tokens=job.image_tokens
        )


@dataclasses.dataclass
class _Run:
    tokens: int = 0
    calls: int = 0
    stopped: str | None = None
    completion: object = None


class _PlainText:
    """Incremental text of a plain completion (an incomplete UTF-8 tail is held back)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def add(self, tokens: list[int], completion) -> str:
        self.ids += tokens
        ids = self.ids
        if completion is not None and ids and ids[-1] in self.tokenizer.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        if completion is None:
            text = text.rstrip("\ufffd")
        out, self.sent = text[self.sent :], max(self.sent, len(text))
        return out
