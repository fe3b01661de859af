"""Anthropic-compatible routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

``thinking: {"type": "enabled", "budget_tokens": N}`` runs in the smallest tier whose budget is
at least N (max if none) and thinks at most min(N, that budget) tokens; ``{"type": "disabled"}``
does not think; absent, the tier is routed automatically (thinking on). With thinking there is
exactly one ``thinking`` block, first; tool calls are ``tool_use`` blocks (stop_reason
``tool_use``); ``usage.output_tokens`` includes thinking, ``usage.output_tokens_details.thinking_tokens``
says how much of it.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from fastapi import APIRouter, Request

from jaxmoe.serve import images, params
from jaxmoe.serve.errors import bad_request
from jaxmoe.serve.service import Outcome, Service
from jaxmoe.serve.streaming import collect, respond, sse_stream
from jaxmoe.serve.tiers import route, tier_for_budget

router = APIRouter()

_STOP = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}


def _service(request: Request) -> Service:
    return request.app.state.service


# ----------------------------------------------------------------------------------------
# Request -> internal messages and options


def _system(body: dict) -> list[dict]:
    system = body.get("system")
    if system is None:
        return []
    return [{"role": "system", "content": params.text_of(system, "system")}]


def _result_text(block: dict, field: str) -> str:
    content = block.get("content")
    text = params.text_of(content, f"{field}.content") if content is not None else ""
    return f"[error] {text}" if block.get("is_error") else text


def _user(i: int, content) -> list[dict]:
    """A user turn: tool_result blocks become tool messages (in order), the text one user message."""
    field = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise bad_request(f"{field}: must be a string or a non-empty list of content blocks", field)
    out, parts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            if parts and isinstance(parts[-1], str):
                parts[-1] += block["text"]
            else:
                parts.append(block["text"])
        elif kind == "image":
            parts.append(images.anthropic_image(block, f"{field}[{j}]"))
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            out.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result_text(block, f"{field}[{j}]")}
            )
        else:
            raise bad_request(f"{field}[{j}]: a user block must be text, image or tool_result, got {kind!r}", field)
    if len(parts) == 1 and isinstance(parts[0], str):
        out.append({"role": "user", "content": parts[0]})
    elif parts:
        content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
        out.append({"role": "user", "content": content})
    return out


def _assistant(i: int, content) -> dict:
    field = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content, "reasoning": None, "tool_calls": []}
    if not isinstance(content, list):
        raise bad_request(f"{field}: must be a string or a list of content blocks", field)
    thinking, text, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque by definition: nothing of it can be rendered
        elif kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input", {}), dict):
            calls.append(
                {"id": block.get("id"), "name": block["name"], "arguments": json.dumps(block.get("input", {}))}
            )
        else:
            raise bad_request(
                f"{field}[{j}]: an assistant block must be thinking, text or tool_use, got {kind!r}", field
            )
    reasoning = "".join(thinking) if thinking else None
    return {"role": "assistant", "content": "".join(text), "reasoning": reasoning, "tool_calls": calls}


def _messages(body: dict) -> list[dict]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty list", "messages")
    out = _system(body)
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user(i, m.get("content"))
        elif role == "assistant":
            out.append(_assistant(i, m.get("content")))
        else:
            raise bad_request(f"messages[{i}].role: must be user or assistant, got {role!r}", "messages")
    return out


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list of {name, description, input_schema}", "tools")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools[{j}]: must be {{name, description, input_schema}}", "tools")
        out.append({"name": t["name"], "description": t.get("description") or "", "parameters": t["input_schema"]})
    return out


def _tool_choice(body: dict, tools: list[dict]) -> tuple[object, bool]:
    """(choice for the decoder, parallel calls allowed)."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        if not tools:
            raise bad_request("tool_choice: 'any' needs tools", "tool_choice")
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if name not in {t["name"] for t in tools}:
            raise bad_request(f"tool_choice: no tool named {name!r} among tools", "tool_choice")
        return {"name": name}, parallel
    raise bad_request("tool_choice.type: must be auto, any, tool or none", "tool_choice")


def _tier(service: Service, body: dict, messages, tools) -> tuple[str, str, int | None]:
    thinking = body.get("thinking")
    if thinking is None:
        tier, rule = route(messages, tools)
        return tier, rule, service.budgets[tier]
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return "low", "thinking-disabled", None
    if kind != "enabled":
        raise bad_request("thinking.type: must be enabled or disabled", "thinking")
    n = thinking.get("budget_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise bad_request(f"thinking.budget_tokens: must be an integer >= 1, got {n!r}", "thinking.budget_tokens")
    tier, budget = tier_for_budget(n, service.budgets)
    return tier, f"budget_tokens={n}", budget


def _job(service: Service, body: dict, tenant: str):
    service.check_model(body.get("model"))
    if "max_tokens" not in body:
        raise bad_request("max_tokens: required, an integer >= 1", "max_tokens")
    messages = _messages(body)
    tools = _tools(body)
    tier, rule, budget = _tier(service, body, messages, tools)
    choice, parallel = _tool_choice(body, tools)
    job = service.chat_job(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        response_schema=None,
        tier=tier,
        rule=rule,
        thinking_budget=budget,
        max_tokens=body.get("max_tokens"),
        max_tokens_field="max_tokens",
        sampling=params.sampling(body),
        stop=params.stop_strings(body, "stop_sequences"),
        tenant=tenant,
        parallel_calls=parallel,
        min_tokens=body.get("min_tokens"),
    )
    job.call_prefix = "toolu_"
    return job


# ----------------------------------------------------------------------------------------
# Responses


def _signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def _usage(o: Outcome) -> dict:
    return {
        "input_tokens": o.prompt_tokens,
        "output_tokens": o.completion_tokens,
        "cache_read_input_tokens": o.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens_details": {"thinking_tokens": o.reasoning_tokens},
    }


def _message_body(service: Service, mid: str, events: list, thinking: bool) -> dict:
    blocks: list[dict] = [{"type": "thinking", "thinking": "", "signature": ""}] if thinking else []
    calls: dict[int, dict] = {}
    outcome = None
    for e in events:
        if isinstance(e, Outcome):
            outcome = e
        elif e.kind == "reasoning":
            blocks[0]["thinking"] += e.text
        elif e.kind == "content":
            if not blocks or blocks[-1]["type"] != "text":
                blocks.append({"type": "text", "text": ""})
            blocks[-1]["text"] += e.text
        elif e.kind == "tool_call":
            calls[e.index] = {"type": "tool_use", "id": e.id, "name": e.name, "input": ""}
            blocks.append(calls[e.index])
        elif e.kind == "arguments":
            calls[e.index]["input"] += e.text
    for block in blocks:
        if block["type"] == "thinking":
            block["signature"] = _signature(block["thinking"])
        if block["type"] == "tool_use":
            block["input"] = _arguments(block["input"])
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": service.model_name,
        "content": blocks,
        "stop_reason": _STOP[outcome.finish],
        "stop_sequence": outcome.stop_sequence,
        "usage": _usage(outcome),
    }


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {"_unparsed_arguments": text}  # an unconstrained call cut by max_tokens
    return value if isinstance(value, dict) else {"value": value}


class _StreamState:
    """Anthropic's event sequence: message_start, blocks (start, deltas, stop), message_delta, message_stop."""

    def __init__(self, service: Service, mid: str, prompt_tokens: int, thinking: bool):
        self.service, self.mid, self.thinking = service, mid, thinking
        self.prompt_tokens, self.open, self.index, self.kind = prompt_tokens, False, -1, None
        self.thought = ""

    def start(self) -> list:
        message = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.service.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        out = [("message_start", json.dumps({"type": "message_start", "message": message}))]
        if self.thinking:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return out

    def _open(self, kind: str, block: dict) -> list:
        out = self._close()
        self.index += 1
        self.kind, self.open = kind, True
        event = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + [("content_block_start", json.dumps(event))]

    def _close(self) -> list:
        if not self.open:
            return []
        out = []
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": _signature(self.thought)}
            out.append(self._delta(delta))
        self.open = False
        return out + [("content_block_stop", json.dumps({"type": "content_block_stop", "index": self.index}))]

    def _delta(self, delta: dict):
        return ("content_block_delta", json.dumps({"type": "content_block_delta", "index": self.index, "delta": delta}))

    def __call__(self, e) -> list:
        if isinstance(e, Outcome):
            out = self._close()
            delta = {"stop_reason": _STOP[e.finish], "stop_sequence": e.stop_sequence}
            body = {"type": "message_delta", "delta": delta, "usage": _usage(e)}
            return out + [("message_delta", json.dumps(body)), ("message_stop", json.dumps({"type": "message_stop"}))]
        if e.kind == "reasoning":
            self.thought += e.text
            return [self._delta({"type": "thinking_delta", "thinking": e.text})]
        if e.kind == "content":
            out = [] if self.kind == "text" and self.open else self._open("text", {"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": e.text})]
        if e.kind == "tool_call":
            return self._open("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
        return [self._delta({"type": "input_json_delta", "partial_json": e.text})]


@router.post("/v1/messages")
async def messages(request: Request):
    service = _service(request)
    body = await params.json_body(request)
    job = _job(service, body, request.state.tenant)
    headers = {"x-jaxmoe-tier": job.tier, "x-jaxmoe-tier-rule": job.rule}
    mid = "msg_" + uuid.uuid4().hex
    if body.get("stream"):
        state = _StreamState(service, mid, len(job.prompt_ids), job.thinking)
        return await sse_stream(request, service, job, state.start(), state, headers)
    events = await collect(request, service, job)
    return respond(_message_body(service, mid, events, job.thinking), headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    service = _service(request)
    body = await params.json_body(request)
    service.check_model(body.get("model"))
    messages = _messages(body)
    tools = _tools(body)
    _, _, budget = _tier(service, body, messages, tools)
    return {"input_tokens": service.count_tokens(messages, tools, thinking=bool(budget))}
