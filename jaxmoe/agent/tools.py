"""Tools an agent session can call: JSON-schema parameters, validation, and bounded concurrent runs.

A tool is a :class:`Tool` (name, description, JSON-schema ``parameters``, ``fn``) or a plain function,
whose schema :func:`tool_from_function` derives from its type hints and its docstring (summary line
and a Google-style ``Args:`` section). Arguments arrive from the model as a JSON string; they are
parsed and validated with ``jsonschema`` before ``fn(**arguments)`` is called, so arguments that are
not JSON or do not match the schema never reach the tool. Whatever happens -- a bad argument, an
exception, a timeout -- becomes the tool result's text, which tells the model what failed.

:func:`run_calls` runs one turn's calls concurrently (at most ``limit`` at once), each on its own
daemon thread with its own deadline; a call that overruns is abandoned (its thread is left to
finish on its own, its slot is given to the next call) and its result says it timed out. Results
come back in the order of the calls, whatever order they finish in.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import jsonschema

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may call: ``fn(**arguments)`` with arguments valid for ``parameters``.

    Attributes:
        name: 1-64 characters of ``[A-Za-z0-9_-]`` (the OpenAI function-name rule).
        description: what the tool does, for the model.
        parameters: a JSON schema of ``type: object`` (checked against the JSON Schema metaschema).
        fn: called with the validated arguments as keywords; its return value becomes the tool
            result (a string as is, anything else as JSON).
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"Tool.name: 1-64 characters of [A-Za-z0-9_-] expected, got {self.name!r}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"Tool {self.name!r}: parameters must be a JSON schema with type 'object'")
        try:
            jsonschema.Draft202012Validator.check_schema(self.parameters)
        except jsonschema.SchemaError as e:
            raise ValueError(f"Tool {self.name!r}: parameters is not a valid JSON schema: {e.message}") from e
        if not callable(self.fn):
            raise ValueError(f"Tool {self.name!r}: fn must be callable")

    def spec(self) -> dict:
        """The OpenAI ``tools`` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _docstring(fn) -> tuple[str, dict[str, str]]:
    """(summary paragraph, {parameter: description}) from a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    described: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)+)", doc, re.MULTILINE)
    if section:
        current = None
        for line in section.group(1).splitlines():
            m = re.match(r"^\s{1,8}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                current = m.group(1)
                described[current] = m.group(2).strip()
            elif current and line.strip():
                described[current] += " " + line.strip()
    return summary, described


def _schema_of(annotation, where: str) -> dict:
    """The JSON schema of a type hint: scalars, list/tuple/set, dict, Literal, Optional and unions."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if annotation is type(None):
        return {"type": "null"}
    if annotation in (list, tuple, set, frozenset) or origin in (list, set, frozenset, Sequence):
        return {"type": "array", **({"items": _schema_of(args[0], where)} if args else {})}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema_of(args[0], where)}
        items = [_schema_of(a, where) for a in args]
        return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str for a JSON object, got {args[0]!r}")
        return {"type": "object", **({"additionalProperties": _schema_of(args[1], where)} if args else {})}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of(a, where) for a in args]}
    if annotation is Any:
        return {}
    raise TypeError(f"{where}: type {annotation!r} has no JSON schema (use str, int, float, bool, list, dict, Literal)")


def tool_from_function(fn: Callable) -> Tool:
    """A :class:`Tool` from a plain function: name, summary and parameter schema from its hints and docstring.

    Every parameter needs a type hint; parameters without a default are required. ``*args`` and
    ``**kwargs`` are refused (the model calls with named arguments only).
    """
    name = getattr(fn, "__name__", None)
    hints = typing.get_type_hints(fn)
    summary, described = _docstring(fn)
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        where = f"tool {name!r} parameter {p.name!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"{where}: only named parameters can come from the model")
        if p.name not in hints:
            raise TypeError(f"{where}: needs a type hint (its JSON schema comes from it)")
        prop = _schema_of(hints[p.name], where)
        if p.name in described:
            prop["description"] = described[p.name]
        if p.default is p.empty:
            required.append(p.name)
        else:
            prop["default"] = p.default
        properties[p.name] = prop
    params = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return Tool(name=name, description=summary, parameters=params, fn=fn)


def as_tools(tools) -> dict[str, Tool]:
    """``{name: Tool}`` from Tools and plain functions; two tools of one name are refused."""
    out: dict[str, Tool] = {}
    for t in tools or ():
        tool = t if isinstance(t, Tool) else tool_from_function(t)
        if tool.name in out:
            raise ValueError(f"tools: two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


def _result_text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)


def checked_arguments(tool: Tool, arguments: str) -> tuple[dict | None, str | None]:
    """(arguments, None) when ``arguments`` is a JSON object valid for the tool; (None, what failed) if not."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, AttributeError) as e:
        return None, f"error: the arguments of {tool.name} are not valid JSON ({e}); the tool was not run"
    if not isinstance(args, dict):
        return None, f"error: the arguments of {tool.name} must be a JSON object, got {type(args).__name__}"
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(tool.parameters).iter_errors(args))
    if err is not None:
        at = "/".join(str(p) for p in err.absolute_path) or "(the arguments)"
        return None, f"error: the arguments of {tool.name} do not match its parameters at {at}: {err.message}"
    return args, None


def _invoke(tool: Tool, args: dict, fut: Future) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result((_result_text(tool.fn(**args)), "ok"))
    except BaseException as e:  # noqa: BLE001 -- any failure of the tool is the model's to read
        fut.set_result((f"error: {tool.name} raised {type(e).__name__}: {e}", "error"))


@dataclasses.dataclass
class CallResult:
    """One tool call's outcome: the text the model reads, and how it went."""

    content: str
    status: str  # "ok", "error" (bad arguments, unknown tool, the tool raised) or "timeout"
    seconds: float


def run_calls(tools: dict[str, Tool], calls: list[tuple[str, str]], *, limit: int, timeout: float) -> list[CallResult]:
    """Runs ``(name, arguments JSON)`` calls, at most ``limit`` at once, each within ``timeout`` seconds.

    Returns one :class:`CallResult` per call, in the order of ``calls``.
    """
    results: list[CallResult | None] = [None] * len(calls)
    queued = list(range(len(calls)))[::-1]
    running: dict[int, tuple[Future, float, float]] = {}
    while queued or running:
        while queued and len(running) < limit:
            i = queued.pop()
            name, arguments = calls[i]
            start = time.monotonic()
            if name not in tools:
                known = ", ".join(sorted(tools)) or "none"
                results[i] = CallResult(
                    f"error: there is no tool named {name!r} (the tools are: {known})", "error", 0.0
                )
                continue
            args, problem = checked_arguments(tools[name], arguments)
            if problem is not None:
                results[i] = CallResult(problem, "error", 0.0)
                continue
            fut: Future = Future()
            threading.Thread(target=_invoke, args=(tools[name], args, fut), daemon=True, name=f"tool-{name}").start()
            running[i] = (fut, start, start + timeout)
        if not running:
            continue
        now = time.monotonic()
        next_deadline = min(d for _, _, d in running.values())
        wait([f for f, _, _ in running.values()], timeout=max(0.0, next_deadline - now), return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for i, (fut, start, deadline) in list(running.items()):
            if fut.done():
                results[i] = CallResult(*fut.result(), now - start)
            elif now >= deadline:
                fut.cancel()
                msg = f"error: {calls[i][0]} timed out after {timeout:g} s; it was abandoned and gave no result"
                results[i] = CallResult(msg, "timeout", now - start)
            else:
                continue
            del running[i]
    return results
