"""Checks of request fields shared by both APIs: each failure is a 400 naming the field."""

from __future__ import annotations

import json

from jaxmoe.inference.sampler import SamplingParams
from jaxmoe.serve.errors import bad_request


async def json_body(request) -> dict:
    """The request's JSON object; 400 (never 422) for a body that is not one."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def number(body: dict, field: str, lo: float, hi: float, default=None, *, lo_open: bool = False):
    value = body.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{field}: must be a number, got {value!r}", field)
    if value < lo or value > hi or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise bad_request(f"{field}: must be in {left}{lo}, {hi}], got {value!r}", field)
    return value


def integer(body: dict, field: str, lo: int, default=None):
    value = body.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise bad_request(f"{field}: must be an integer >= {lo}, got {value!r}", field)
    return value


def min_tokens(value, limit: int, limit_field: str) -> int:
    """``min_tokens`` (vLLM's extension): an integer in [0, the answer's max tokens], default 0."""
    n = integer({"min_tokens": value}, "min_tokens", 0, 0)
    if n > limit:
        raise bad_request(f"min_tokens: must be <= {limit_field} ({limit}), got {n}", "min_tokens")
    return n


def sampling(body: dict, *, top_k_field: str = "top_k") -> SamplingParams:
    """temperature [0, 2] (default 1), top_p (0, 1], top_k >= 0, seed (any integer; random if absent)."""
    seed = body.get("seed")
    if seed is None:
        import secrets  # noqa: PLC0415

        seed = secrets.randbits(32)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise bad_request(f"seed: must be an integer, got {seed!r}", "seed")
    return SamplingParams(
        temperature=float(number(body, "temperature", 0.0, 2.0, 1.0)),
        top_p=float(number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)),
        top_k=int(integer(body, top_k_field, 0, 0)),
        seed=seed % 2**32,
    )


def stop_strings(body: dict, field: str, most: int = 16) -> tuple[str, ...]:
    value = body.get(field)
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values) or len(values) > most:
        raise bad_request(f"{field}: must be a non-empty string or a list of at most {most} of them", field)
    return tuple(values)


def unsupported(body: dict, fields: dict) -> None:
    """400 for a field given with a value this server does not implement (never ignored silently)."""
    for field, allowed in fields.items():
        if field in body and body[field] is not None and body[field] not in allowed:
            raise bad_request(f"{field}: {body[field]!r} is not supported by this server (allowed: {allowed})", field)


def text_of(content, field: str) -> str:
    """A string, or the text of a list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{field}: must be a string or a list of content parts", field)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{field}[{j}]: only text parts are supported, got {kind!r}", f"{field}[{j}]")
        out.append(part["text"])
    return "".join(out)
