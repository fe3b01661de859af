"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

Reasoning comes back in ``message.reasoning_content`` (and the same text in ``message.reasoning``),
streamed in ``delta.reasoning_content``; ``usage.completion_tokens`` counts reasoning too, and
``completion_tokens_details.reasoning_tokens`` says how much of it. Tool calls come back as
``tool_calls`` (finish_reason ``tool_calls``), streamed as a start (id, name) then argument
fragments.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request

from jaxmoe.serve import images, params
from jaxmoe.serve.errors import bad_request
from jaxmoe.serve.service import Event, Outcome, Service
from jaxmoe.serve.streaming import collect, respond, sse_stream
from jaxmoe.serve.tiers import route, tier_for_effort

router = APIRouter()

_UNSUPPORTED = {
    "n": (1,),
    "logprobs": (False,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


def _service(request: Request) -> Service:
    return request.app.state.service


@router.get("/v1/models")
async def models(request: Request):
    s = _service(request)
    return {
        "object": "list",
        "data": [
            {
                "id": s.model_name,
                "object": "model",
                "created": s.created,
                "owned_by": "jaxmoe",
                "max_model_len": s.engine_limit,  # vLLM's field: the context a request may fill, in tokens
            }
        ],
    }


# ----------------------------------------------------------------------------------------
# Request -> internal messages and options


def _message(i: int, m) -> dict:
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{field}: must be an object", field)
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise bad_request(f"{field}.role: must be system, developer, user, assistant or tool, got {role!r}", field)
    content = m.get("content")
    if role == "user" and isinstance(content, list):
        content = _user_content(content, f"{field}.content")
    else:
        content = params.text_of(content, f"{field}.content")
    out = {"role": "system" if role == "developer" else role, "content": content}
    if role == "assistant":
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise bad_request(f"{field}.reasoning_content: must be a string", field)
        out["reasoning"] = reasoning
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise bad_request(f"{field}.tool_calls: must be a list", field)
        out["tool_calls"] = [_call(f"{field}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"{field}.tool_call_id: required for a tool message, a string", field)
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _user_content(parts: list, field: str) -> str | list:
    """A user's content parts: their text, or with ``image_url`` parts the parts in order (adjacent
    texts joined as ``text_of`` joins them)."""
    out: list = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            out.append(images.openai_image(part, f"{field}[{j}]"))
        elif kind == "text" and isinstance(part.get("text"), str):
            if out and isinstance(out[-1], dict):
                out[-1] = {"type": "text", "text": out[-1]["text"] + part["text"]}
            else:
                out.append({"type": "text", "text": part["text"]})
        else:
            raise bad_request(
                f"{field}[{j}]: a user content part must be text or image_url, got {kind!r}", f"{field}[{j}]"
            )
    if not any(isinstance(p, images.ImagePart) for p in out):
        return out[0]["text"] if out else ""
    return out


def _call(field: str, c) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{field}.function.name: required, a string", field)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return {"id": c.get("id"), "name": fn["name"], "arguments": args}


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list of {type: function, function: {...}}", "tools")
    out = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{j}]: must be {{type: function, function: {{name, parameters}}}}", "tools")
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": schema})
    return out


def _tool_choice(body: dict, tools: list[dict]):
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise bad_request("tool_choice: 'required' needs tools", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice: must be auto, none, required or {type: function, function: {name}}", "tool_choice"
        )
    if name not in {t["name"] for t in tools}:
        raise bad_request(f"tool_choice: no tool named {name!r} among tools", "tool_choice")
    return {"name": name}


def _response_schema(body: dict) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if isinstance(schema, dict):
            return schema
    raise bad_request(
        "response_format: must be {type: text}, {type: json_object} or {type: json_schema, json_schema: {schema}}",
        "response_format",
    )


def _tier(service: Service, body: dict, messages, tools) -> tuple[str, str, int | None]:
    """(tier, rule, thinking budget or None) from reasoning_effort, or auto routing."""
    effort = body.get("reasoning_effort")
    if effort is None:
        tier, rule = route(messages, tools)
        return tier, rule, service.budgets[tier]
    try:
        tier, thinking = tier_for_effort(effort)
    except ValueError as e:
        raise bad_request(str(e), "reasoning_effort") from e
    return tier, f"reasoning_effort={effort}", service.budgets[tier] if thinking else None


def _chat_job(service: Service, body: dict, tenant: str):
    params.unsupported(body, _UNSUPPORTED)
    service.check_model(body.get("model"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty list", "messages")
    messages = [_message(i, m) for i, m in enumerate(raw)]
    tools = _tools(body)
    tier, rule, budget = _tier(service, body, messages, tools)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    parallel = body.get("parallel_tool_calls", True)
    return service.chat_job(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        response_schema=_response_schema(body),
        tier=tier,
        rule=rule,
        thinking_budget=budget,
        max_tokens=body.get(field),
        max_tokens_field=field,
        sampling=params.sampling(body),
        stop=params.stop_strings(body, "stop"),
        tenant=tenant,
        parallel_calls=parallel is not False,
        min_tokens=body.get("min_tokens"),
    )


# ----------------------------------------------------------------------------------------
# Chat completions


def _usage(o: Outcome) -> dict:
    return {
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": o.reasoning_tokens},
        "prompt_tokens_details": {
            "cached_tokens": o.cached_tokens,
            "image_tokens": o.image_tokens,
            "text_tokens": o.prompt_tokens - o.image_tokens,
        },
    }


def _chat_body(service: Service, rid: str, events: list, thinking: bool) -> dict:
    reasoning, content, calls = "", "", []
    outcome = None
    for e in events:
        if isinstance(e, Outcome):
            outcome = e
        elif e.kind == "reasoning":
            reasoning += e.text
        elif e.kind == "content":
            content += e.text
        elif e.kind == "tool_call":
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif e.kind == "arguments":
            calls[e.index]["function"]["arguments"] += e.text
    message = {"role": "assistant", "content": content if content or not calls else None}
    message["reasoning_content"] = message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": _FINISH[outcome.finish], "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": service.model_name,
        "choices": [choice],
        "usage": _usage(outcome),
    }


def _chunk(service: Service, rid: str, delta: dict, finish=None, usage=None, include_usage=False) -> str:
    body = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": service.model_name,
        "choices": []
        if usage is not None
        else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    if include_usage:
        body["usage"] = usage
    return json.dumps(body)


def _chat_chunks(service: Service, rid: str, include_usage: bool):
    """Turns events into chat.completion.chunk JSON strings."""

    def chunks(event):
        if isinstance(event, Outcome):
            out = [_chunk(service, rid, {}, _FINISH[event.finish], include_usage=include_usage)]
            if include_usage:
                out.append(_chunk(service, rid, {}, usage=_usage(event), include_usage=True))
            return out
        if event.kind == "reasoning":
            delta = {"reasoning_content": event.text, "reasoning": event.text}
        elif event.kind == "content":
            delta = {"content": event.text}
        elif event.kind == "tool_call":
            fn = {"name": event.name, "arguments": ""}
            delta = {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": fn}]}
        else:
            delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        return [_chunk(service, rid, delta, include_usage=include_usage)]

    first = _chunk(service, rid, {"role": "assistant", "content": ""}, include_usage=include_usage)
    return first, chunks


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    service = _service(request)
    tenant = request.state.tenant
    body = await params.json_body(request)
    job = _chat_job(service, body, tenant)
    headers = {"x-jaxmoe-tier": job.tier, "x-jaxmoe-tier-rule": job.rule}
    rid = "chatcmpl-" + uuid.uuid4().hex
    if body.get("stream"):
        opts = body.get("stream_options") or {}
        first, chunks = _chat_chunks(service, rid, bool(opts.get("include_usage")))
        return await sse_stream(request, service, job, first, chunks, headers, done="[DONE]")
    events = await collect(request, service, job)
    return respond(_chat_body(service, rid, events, job.thinking), headers)


# ----------------------------------------------------------------------------------------
# Plain completions


def _prompt_ids(service: Service, prompt) -> list[int]:
    tok = service.tokenizer
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return [tok.eos_id, *tok.encode(prompt)]  # as `jaxmoe generate` (documents follow an eos)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if min(prompt) < 0 or max(prompt) >= service.vocab_size:
            raise bad_request(f"prompt: token ids must be in [0, {service.vocab_size})", "prompt")
        return list(prompt)
    raise bad_request("prompt: must be a non-empty string or a non-empty list of token ids (one prompt)", "prompt")


def _completion_job(service: Service, body: dict, tenant: str):
    params.unsupported(body, {**_UNSUPPORTED, "echo": (False,), "best_of": (1,), "suffix": ()})
    service.check_model(body.get("model"))
    prompt = _prompt_ids(service, body.get("prompt"))
    max_tokens = service.max_tokens(body.get("max_tokens", 16), len(prompt), "max_tokens")
    min_tokens = params.min_tokens(body.get("min_tokens"), max_tokens, "max_tokens")
    from jaxmoe.inference.scheduler import Request as EngineRequest  # noqa: PLC0415
    from jaxmoe.serve.service import Job  # noqa: PLC0415

    request = EngineRequest(
        tuple(prompt),
        max_tokens=max_tokens,
        sampling=params.sampling(body),
        stop=params.stop_strings(body, "stop"),
        tenant=tenant,
        min_tokens=min_tokens,
    )
    return Job("low", "completions", prompt, request, thinking=False, decoding=None)


def _completion_chunks(service: Service, rid: str, include_usage: bool):
    def chunk(text, finish=None, usage=None):
        body = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": service.model_name,
            "choices": [] if usage else [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        }
        if include_usage:
            body["usage"] = usage
        return json.dumps(body)

    def chunks(event):
        if isinstance(event, Outcome):
            out = [chunk("", _FINISH[event.finish])]
            if include_usage:
                out.append(chunk("", usage=_usage(event)))
            return out
        return [chunk(event.text)]

    return None, chunks


@router.post("/v1/completions")
async def completions(request: Request):
    service = _service(request)
    body = await params.json_body(request)
    job = _completion_job(service, body, request.state.tenant)
    headers = {"x-jaxmoe-tier": job.tier}
    rid = "cmpl-" + uuid.uuid4().hex
    if body.get("stream"):
        opts = body.get("stream_options") or {}
        first, chunks = _completion_chunks(service, rid, bool(opts.get("include_usage")))
        return await sse_stream(request, service, job, first, chunks, headers, done="[DONE]")
    events = await collect(request, service, job)
    text = "".join(e.text for e in events if isinstance(e, Event))
    outcome = events[-1]
    choice = {"index": 0, "text": text, "finish_reason": _FINISH[outcome.finish], "logprobs": None}
    body = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": service.model_name,
        "choices": [choice],
        "usage": _usage(outcome),
    }
    return respond(body, headers)
