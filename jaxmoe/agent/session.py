"""``AgentSession``: a tool-calling loop over any OpenAI-compatible chat endpoint, history kept whole.

One turn is one ``chat.completions`` request with the whole history; an answer with tool calls has
its calls run (concurrently, up to ``max_parallel_tools``) and their results appended in the order
of the calls, and the next turn follows; an answer without tool calls is the final answer.

**Retries.** The session owns them: the client is used with ``max_retries=0`` and ``timeout`` per
attempt, and a turn makes at most ``max_retries + 1`` requests. Timeouts, connection errors, HTTP 429
and 5xx are retried; every other status (4xx) is not. Between attempts the session sleeps the
server's ``Retry-After`` (``retry-after-ms`` or ``Retry-After``, seconds or an HTTP date; at most
600 s) when it sent one, else ``d/2 + uniform(0, d/2)`` with ``d = min(backoff_cap, backoff_base *
2**attempt)`` (defaults 1 s and 30 s: 0.5-1 s, 1-2 s, 2-4 s, ...). Nothing is appended before a turn
succeeds, so a retried turn is never recorded twice.

**History.** ``messages`` is exactly what the next turn sends (plus, at the end, the final answer):
every assistant message with its reasoning, under the key the endpoint used (``reasoning_content``
or ``reasoning``), sent back unchanged, and its tool calls; every tool result. Nothing is ever
dropped: when the last turn's prompt and answer leave fewer than ``context_reserve`` tokens of the
model's context (``context_tokens``, or the ``max_model_len`` that ``GET /v1/models`` reports), the
session stops with an :class:`AgentError` naming the token counts. When ``run()`` raises, every
completed message stays in ``messages``; ``save()`` then ``resume()`` continues from there.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import time
from collections.abc import Callable

import openai

from jaxmoe.agent.tools import as_tools, run_calls

THINKING = {"auto": None, "low": "low", "high": "high", "max": "max"}
RETRY_AFTER_LIMIT = 600.0
FORMAT = "jaxmoe.agent/1"
OWNED = {"model", "messages", "tools", "tool_choice", "reasoning_effort", "max_tokens", "stream", "n", "timeout"}


class AgentError(RuntimeError):
    """The session could not go on: retries spent, a refused request, max_turns, or a full context.

    Attributes:
        attempts: requests made for the failing turn (None when no request failed).
        status: the last failure: an HTTP status code, "timeout" or "connection error" (or None).
    """

    def __init__(self, message: str, *, attempts: int | None = None, status=None):
        super().__init__(message)
        self.attempts, self.status = attempts, status


def _positive(name: str, value, *, integer: bool, allow_zero: bool = False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < 0 or (value == 0 and not allow_zero):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"AgentSession {name}: must be {kind} {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def _retry_after(response) -> float | None:
    """Seconds the server asked to wait (``retry-after-ms``, ``Retry-After`` seconds or HTTP date), or None."""
    headers = getattr(response, "headers", None) or {}
    try:
        if headers.get("retry-after-ms") is not None:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        value = headers.get("retry-after")
        if value is None:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def detail(e: openai.APIStatusError) -> str:
    """The error's own message (both APIs put it in ``error.message``), else the SDK's summary."""
    body = e.body if isinstance(e.body, dict) else {}
    inner = body.get("error", body)
    message = inner.get("message") if isinstance(inner, dict) else None
    return message if isinstance(message, str) else e.message


def _assistant_message(message) -> dict:
    """The assistant message as the endpoint returned it: content, reasoning under its own key, tool calls."""
    out = {"role": "assistant", "content": message.content}
    extra = message.model_extra or {}
    for key in ("reasoning_content", "reasoning"):
        value = extra.get(key, getattr(message, key, None))
        if value is not None:
            out[key] = value
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
    return out


def _pending_calls(messages: list[dict]) -> list[dict]:
    """The last assistant message's tool calls that have no tool result yet (a run cut off mid-turn)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            answered = {m.get("tool_call_id") for m in messages[i + 1 :] if m.get("role") == "tool"}
            return [c for c in messages[i].get("tool_calls") or [] if c.get("id") not in answered]
    return []


class AgentSession:
    """A long-horizon agent over an OpenAI-compatible endpoint (ours, vLLM, SGLang).

    Args:
        client: a synchronous ``openai.OpenAI``; its own retries are not used.
        tools: :class:`~jaxmoe.agent.Tool`\\ s and plain functions (schema from type hints and docstring).
        model: the model id to request.
        thinking: ``auto`` (no ``reasoning_effort``: the server routes), ``low``, ``high`` or ``max``.
        timeout: seconds each model request attempt and each tool call may take.
        max_turns: model requests one ``run()`` may make before it gives up.
        max_retries: extra attempts of one turn after a retryable failure.
        max_parallel_tools: tool calls of one turn that run at once.
        tool_choice: sent as ``tool_choice`` (``auto``, ``none``, ``required``, a named tool) or a
            function of the turn's index within ``run()`` giving it.
        max_tokens: the answer's token limit per turn (None: the server's default).
        system: a system message that opens a new history.
        context_tokens: the model's context in tokens (None: ``max_model_len`` from ``GET /v1/models``).
        context_reserve: tokens that must be left for the next tool results and answer
            (None: a tenth of the context).
        backoff_base, backoff_cap: seconds, see the module docstring.
        request_options: more fields of every request (``temperature``, ``top_p``, ``stop``, ``seed``,
            ``extra_body``, ...); the fields the session sets itself are refused here.
    """

    def __init__(
        self,
        client: openai.OpenAI,
        tools=(),
        *,
        model: str,
        thinking: str = "auto",
        timeout: float = 600.0,
        max_turns: int = 32,
        max_retries: int = 3,
        max_parallel_tools: int = 4,
        tool_choice: str | dict | Callable[[int], str | dict] = "auto",
        max_tokens: int | None = None,
        system: str | None = None,
        context_tokens: int | None = None,
        context_reserve: int | None = None,
        backoff_base: float = 1.0,
        backoff_cap: float = 30.0,
        request_options: dict | None = None,
    ):
        if thinking not in THINKING:
            raise ValueError(f"AgentSession thinking: must be one of {', '.join(THINKING)}, got {thinking!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"AgentSession model: must be a non-empty string, got {model!r}")
        self.client, self.model, self.thinking = client, model, thinking
        self.tools = as_tools(tools)
        self.timeout = _positive("timeout", timeout, integer=False)
        self.max_turns = _positive("max_turns", max_turns, integer=True)
        self.max_retries = _positive("max_retries", max_retries, integer=True, allow_zero=True)
        self.max_parallel_tools = _positive("max_parallel_tools", max_parallel_tools, integer=True)
        self.backoff_base = _positive("backoff_base", backoff_base, integer=False, allow_zero=True)
        self.backoff_cap = _positive("backoff_cap", backoff_cap, integer=False, allow_zero=True)
        for name, value in (("max_tokens", max_tokens), ("context_tokens", context_tokens)):
            if value is not None:
                _positive(name, value, integer=True)
        if context_reserve is not None:
            _positive("context_reserve", context_reserve, integer=True, allow_zero=True)
        owned = sorted(set(request_options or {}) & OWNED)
        if owned:
            raise ValueError(f"AgentSession request_options: {', '.join(owned)} are set by the session itself")
        self.tool_choice, self.max_tokens, self.request_options = tool_choice, max_tokens, dict(request_options or {})
        self.context_tokens, self.context_reserve = context_tokens, context_reserve
        self._context_known = context_tokens is not None
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []

    # ------------------------------------------------------------------------------------
    # The loop

    def run(self, task: str | None = None) -> str:
        """Appends ``task`` as a user message (None: continue the history) and runs turns to a final answer.

        Raises:
            AgentError: retries spent or a request refused (``attempts``, ``status``), ``max_turns``
                reached, the answer cut at its token limit, or the context nearly full.
        """
        if task is not None:
            if not isinstance(task, str):
                raise ValueError(f"run(task): must be a string or None, got {type(task).__name__}")
            self.messages.append({"role": "user", "content": task})
        elif not self.messages or (self.messages[-1].get("role") == "assistant" and not _pending_calls(self.messages)):
            raise ValueError("run(): no task given and the history has nothing to continue (it ends in an answer)")
        for turn in range(self.max_turns):
            self._run_tools(_pending_calls(self.messages))
            self._check_context()
            message, record = self._request(turn)
            self.messages.append(message)
            self.turns.append(record)
            if message.get("tool_calls"):
                record["tools"] = self._run_tools(message["tool_calls"])
                continue
            if record["finish_reason"] == "length":
                raise AgentError(
                    f"turn {len(self.turns)}: the answer was cut at its token limit (finish_reason=length, "
                    f"{record['usage'].get('completion_tokens')} tokens); it is kept in messages"
                )
            return message.get("content") or ""
        raise AgentError(f"max_turns={self.max_turns} turns ran without a final answer")

    def _run_tools(self, calls: list[dict]) -> list[dict]:
        if not calls:
            return []
        pairs = [(c["function"]["name"], c["function"].get("arguments") or "") for c in calls]
        results = run_calls(self.tools, pairs, limit=self.max_parallel_tools, timeout=self.timeout)
        for call, result in zip(calls, results, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.content})
        return [
            {"name": name, "status": r.status, "seconds": round(r.seconds, 4)}
            for (name, _), r in zip(pairs, results, strict=True)
        ]

    def _request_kwargs(self, turn: int) -> dict:
        kwargs = {**self.request_options, "model": self.model, "messages": self.messages}
        if self.tools:
            kwargs["tools"] = [t.spec() for t in self.tools.values()]
            kwargs["tool_choice"] = self.tool_choice(turn) if callable(self.tool_choice) else self.tool_choice
        if THINKING[self.thinking] is not None:
            kwargs["reasoning_effort"] = THINKING[self.thinking]
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        return kwargs

    def _request(self, turn: int) -> tuple[dict, dict]:
        """One turn's request with the session's retries: (assistant message, turn record)."""
        client = self.client.with_options(max_retries=0, timeout=self.timeout)
        kwargs, failures, started = self._request_kwargs(turn), [], time.monotonic()
        for attempt in range(self.max_retries + 1):
            t0 = time.monotonic()
            try:
                response = client.chat.completions.create(**kwargs)
            except openai.APIConnectionError as e:
                status, wait = ("timeout" if isinstance(e, openai.APITimeoutError) else "connection error"), None
            except openai.APIStatusError as e:
                status, wait = e.status_code, _retry_after(e.response)
                if status != 429 and status < 500:
                    raise AgentError(
                        f"turn {len(self.turns) + 1}: the endpoint refused the request with HTTP {status} "
                        f"(not retried): {detail(e)}",
                        attempts=attempt + 1,
                        status=status,
                    ) from e
            else:
                return self._record(response, attempt + 1, time.monotonic() - t0, started, failures)
            failures.append(status)
            if attempt == self.max_retries:
                raise AgentError(
                    f"turn {len(self.turns) + 1}: {attempt + 1} attempts failed (max_retries={self.max_retries}); "
                    f"the last: {status}; all: {failures}",
                    attempts=attempt + 1,
                    status=status,
                )
            time.sleep(min(wait, RETRY_AFTER_LIMIT) if wait is not None else self._backoff(attempt))
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_cap, self.backoff_base * 2**attempt)
        return d / 2 + random.uniform(0, d / 2)

    def _record(self, response, attempts: int, latency: float, started: float, failures: list) -> tuple[dict, dict]:
        if not response.choices:
            raise AgentError(f"turn {len(self.turns) + 1}: the endpoint answered with no choices", attempts=attempts)
        choice = response.choices[0]
        usage = response.usage.model_dump(exclude_none=True) if response.usage else {}
        record = {
            "turn": len(self.turns) + 1,
            "attempts": attempts,
            "failures": failures,
            "latency_s": round(latency, 4),
            "elapsed_s": round(time.monotonic() - started, 4),
            "finish_reason": choice.finish_reason,
            "usage": usage,
        }
        return _assistant_message(choice.message), record

    # ------------------------------------------------------------------------------------
    # The context

    def _context_limit(self) -> int | None:
        if not self._context_known:
            self._context_known = True
            try:
                listed = self.client.with_options(max_retries=0, timeout=self.timeout).models.list()
                for m in listed.data:
                    extra = m.model_extra or {}
                    if m.id == self.model and isinstance(extra.get("max_model_len"), int):
                        self.context_tokens = extra["max_model_len"]
            except openai.OpenAIError:
                pass  # an endpoint without /v1/models: its own context error (HTTP 400) stops the session
        return self.context_tokens

    def _check_context(self) -> None:
        limit = self._context_limit()
        if limit is None or not self.turns:
            return
        used = self.turns[-1]["usage"].get("total_tokens")
        reserve = self.context_reserve if self.context_reserve is not None else limit // 10
        if used is not None and used + reserve > limit:
            raise AgentError(
                f"the history is {used} tokens (the last turn's prompt and answer) and the model's context is "
                f"{limit} tokens: fewer than context_reserve={reserve} tokens are left for tool results and the next "
                "answer; the session stops rather than drop any history (save() it and start a new session)"
            )

    # ------------------------------------------------------------------------------------
    # Transcripts

    def save(self, path) -> None:
        """Writes the transcript as JSON lines (a header, every message, every turn record), atomically."""
        header = {"type": "session", "format": FORMAT, "model": self.model, "thinking": self.thinking}
        header["tools"] = sorted(self.tools)
        lines = [header] + [{"type": "message", "message": m} for m in self.messages]
        lines += [{"type": "turn", "record": t} for t in self.turns]
        tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        os.replace(tmp, path)

    @classmethod
    def resume(cls, path, client: openai.OpenAI, tools=(), **options) -> AgentSession:
        """A session with the saved transcript's history, model and thinking; ``options`` as in the constructor."""
        header, messages, turns = None, [], []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    item = json.loads(line)
                    kind = item["type"]
                    if n == 1 and (kind != "session" or item.get("format") != FORMAT):
                        raise ValueError(f"not a {FORMAT} transcript header")
                    if kind == "session":
                        header = item
                    elif kind == "message":
                        messages.append(dict(item["message"]))
                    elif kind == "turn":
                        turns.append(dict(item["record"]))
                    else:
                        raise ValueError(f"unknown record type {kind!r}")
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{os.fspath(path)} line {n}: {e}") from e
        if header is None:
            raise ValueError(f"{os.fspath(path)}: empty, not a {FORMAT} transcript")
        options.setdefault("model", header["model"])
        options.setdefault("thinking", header["thinking"])
        session = cls(client, tools, **options)
        session.messages, session.turns = messages, turns
        return session
