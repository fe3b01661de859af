"""Verifiable-reward domains for GRPO: prompts, and verifiers that score a parsed answer in [0, 1].

Three domains, each built from the Python standard library the model was pretrained on:

- ``code``: complete the start of a real stdlib function so the text compiles (:func:`code_reward`).
- ``tool_args``: write the JSON arguments of a call to a real stdlib callable, checked against a
  JSON schema made from its signature (:func:`tool_args_reward`).
- ``budget``: answer a short question, closing the thinking block before the tier's budget forces
  it (:func:`budget_reward`).

Rewards are graded, not pass/fail: a tiny model needs partial credit to see differences within a
group of samples within a few dozen steps. Verifiers never execute model output: they only use
``ast.parse``, ``codeop.compile_command``, ``json.loads`` and ``jsonschema``.

Train and held-out prompts come from disjoint pools, split by ``zlib.crc32`` of a stable key of each
source item (never the salted ``hash()``), and ``prompts(split, n, seed)`` is a pure function of
its arguments.
"""

from __future__ import annotations

import ast
import codeop
import copy
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import random
import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema

TIERS = ("low", "high", "max")
SPLITS = ("train", "heldout")


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a verifier sees of one generated turn.

    Attributes:
      reasoning: the thinking text ("" when none).
      content: the answer text.
      reasoning_tokens: ids generated inside thinking, the closing token excluded.
      thinking_budget: the tier's budget this rollout ran with (reasoning tokens).
      finished: the turn ended on its own (an end token), not cut at ``max_tokens``.
      thinking_closed: the model closed thinking itself, before the budget forced it, and went on
        to answer (see :func:`answer_from`).
    """

    reasoning: str
    content: str
    reasoning_tokens: int
    thinking_budget: int
    finished: bool
    thinking_closed: bool


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One RL prompt.

    Attributes:
      domain: the name of the domain that made it (a key of :data:`DOMAINS`).
      messages: native chat messages, each ``{"role": "system" | "user", "content": str}``.
      tier: the thinking tier, one of :data:`TIERS`.
      data: what the domain's verifier needs, JSON-serialisable.
    """

    domain: str
    messages: tuple[dict, ...]
    tier: str
    data: Mapping


def answer_from(parsed: Any, *, thinking_budget: int, finished: bool) -> Answer:
    """The :class:`Answer` of a parsed turn (a :class:`jaxmoe.chat.parser.Parsed`, duck-typed).

    The decoding constraint forces the end of thinking exactly when ``reasoning_tokens`` reaches
    ``thinking_budget``, so the model closed thinking itself iff ``reasoning_tokens <
    thinking_budget``. A budget of 0 forbids thinking outright; nothing is overlong then, so it
    counts as closed. Either way the model must also have started its answer (non-empty content or
    a tool call): a turn that ended inside thinking parses with empty content too.

    Args:
      parsed: has ``reasoning`` (str), ``content`` (str), ``reasoning_tokens`` (int) and optionally
        ``tool_calls``.
      thinking_budget: the tier's budget the rollout ran with, >= 0.
      finished: the turn ended on an end token (finish reason "stop").

    Returns:
      The answer.
    """
    if isinstance(thinking_budget, bool) or not isinstance(thinking_budget, int) or thinking_budget < 0:
        raise ValueError(f"thinking_budget must be an int >= 0, got {thinking_budget!r}")
    tokens = int(parsed.reasoning_tokens)
    started = parsed.content != "" or bool(getattr(parsed, "tool_calls", None))
    return Answer(
        reasoning=parsed.reasoning,
        content=parsed.content,
        reasoning_tokens=tokens,
        thinking_budget=thinking_budget,
        finished=bool(finished),
        thinking_closed=(tokens < thinking_budget or thinking_budget == 0) and started,
    )


# --------------------------------------------------------------------------------------------
# Verifiers


def _compiles(text: str) -> float:
    """1.0 a complete statement block, 0.5 an incomplete but valid start, 0.0 a syntax error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            ast.parse(text, mode="exec")
            return 1.0
        except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
            pass
        try:
            codeop.compile_command(text, symbol="exec")
        except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
            return 0.0
        # None (needs more input) or, rarely, code that ast.parse refused: valid so far, not complete.
        return 0.5


def code_reward(data: Mapping, answer: Answer) -> float:
    """How well ``data["prefix"] + answer.content`` compiles.

    Levels:
      1.0: the content is non-empty and the whole text parses (``ast.parse``) as a statement block;
      0.5: non-empty content, the text is incomplete but could still be valid
        (``codeop.compile_command`` asks for more input);
      0.0: a syntax error, or empty / whitespace-only content (the model must write something;
        a prefix that already compiles must not earn credit by itself).

    Nothing is executed; compiler warnings are suppressed.
    """
    if not answer.content.strip():
        return 0.0
    return _compiles(data["prefix"] + answer.content)


def _first_object_span(text: str) -> str | None:
    """The first balanced ``{...}`` span of ``text`` (braces inside JSON strings ignored), or None."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
    return None


def _loads(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; so is an overlong int
        return False, None


def tool_args_reward(data: Mapping, answer: Answer) -> float:
    """How close ``answer.content`` is to valid JSON arguments for ``data["schema"]``.

    The content is stripped, then parsed with ``json.loads``; if that fails, its first balanced
    ``{...}`` span is parsed instead (a remark after the object is forgiven).

    Levels:
      0.0: the content does not start with ``{``;
      0.25: it starts with ``{`` but neither it nor its first ``{...}`` span is valid JSON;
      0.5: a JSON object;
      0.75: an object whose keys are all properties of the schema;
      1.0: an object that validates against the schema (Draft 2020-12).
    """
    text = answer.content.strip()
    if not text.startswith("{"):
        return 0.0
    ok, value = _loads(text)
    if not ok:
        span = _first_object_span(text)
        ok, value = _loads(span) if span is not None else (False, None)
    if not ok or not isinstance(value, dict):
        return 0.25
    schema = data["schema"]
    if not set(value) <= set(schema.get("properties", {})):
        return 0.5
    if not jsonschema.Draft202012Validator(schema).is_valid(value):
        return 0.75
    return 1.0


def budget_reward(data: Mapping, answer: Answer) -> float:
    """How early the model closed thinking and answered; ``data`` is unused.

    Levels:
      0.0: thinking was not closed by the model (the budget forced it: overlong), or the content is
        empty / whitespace-only;
      otherwise ``0.5 + 0.5 * (1 - reasoning_tokens / thinking_budget)``, clipped to [0, 1] (1.0
        when the budget is 0): an answer after shorter thinking scores higher;
      times 0.5 when the turn did not finish on its own (cut at ``max_tokens``).
    """
    del data
    if not answer.thinking_closed or not answer.content.strip():
        return 0.0
    if answer.thinking_budget <= 0:
        score = 1.0
    else:
        score = 0.5 + 0.5 * (1.0 - answer.reasoning_tokens / answer.thinking_budget)
        score = min(1.0, max(0.0, score))
    return score if answer.finished else 0.5 * score


# --------------------------------------------------------------------------------------------
# Domains


def _is_heldout(key: str, every: int) -> bool:
    return zlib.crc32(key.encode("utf-8")) % every == 0


class Domain:
    """A reward domain: a pool of source items per split, a prompt per item, a verifier.

    Subclasses set ``name`` and implement ``_pool(split)`` (the split's items, a stable order),
    ``_make(item, tier, rng)`` (the prompt's messages and data) and ``reward``.
    """

    name: str = ""

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]:
        """``n`` prompts of ``split``, the same for the same arguments.

        The split's pool is shuffled with ``seed`` and walked in order, reshuffled on each pass
        when ``n`` exceeds it; tiers cycle through :data:`TIERS`, shifted by one on each pass so a
        repeated item gets another tier.

        Args:
          split: ``"train"`` or ``"heldout"`` (disjoint pools).
          n: number of prompts, >= 1.
          seed: the shuffle's seed.

        Returns:
          The prompts.
        """
        if split not in SPLITS:
            raise ValueError(f"split is {split!r}; allowed: {', '.join(SPLITS)}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        pool = self._pool(split)
        rng = random.Random(f"{self.name}/{split}/{int(seed)}")  # str seeds are stable across runs
        out: list[Prompt] = []
        order: list = []
        for i in range(n):
            if i % len(pool) == 0:
                order = list(pool)
                rng.shuffle(order)
            tier = TIERS[(i + i // len(pool)) % len(TIERS)]
            messages, data = self._make(order[i % len(pool)], tier, rng)
            out.append(Prompt(self.name, tuple(messages), tier, data))
        return out

    def reward(self, data: Mapping, answer: Answer) -> float:
        """The answer's reward in [0, 1]."""
        raise NotImplementedError

    def _pool(self, split: str) -> Sequence:
        raise NotImplementedError

    def _make(self, item: Any, tier: str, rng: random.Random) -> tuple[list[dict], dict]:
        raise NotImplementedError


# ---- code


CODE_MODULES = (
    "textwrap, string, shlex, fnmatch, posixpath, glob, colorsys, bisect, heapq, keyword, calendar, difflib, "
    "filecmp, fractions, html, imghdr, netrc, numbers, operator, pprint, queue, quopri, sched, stat, statistics, "
    "tokenize, uu, wave"
).split(", ")
CODE_PROMPT = "Complete this Python code:\n"
_MAX_PREFIX_CHARS = 400
_MAX_BODY_LINES = 2


@dataclasses.dataclass(frozen=True)
class _Function:
    key: str  # the header text: equal headers share a split, so split prefixes never coincide
    prefixes: tuple[str, ...]  # the header plus 0, 1, 2 body lines, each a valid start
    source: str = ""  # the whole function (what a demonstration continues a prefix with)


def _module_source(name: str) -> str | None:
    """A module's source read from its file, never imported (some of these warn on import)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def _functions(source: str) -> list[_Function]:
    """The top-level ``def`` statements of a module, as their prompt prefixes."""
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        start, body_start, end = node.lineno - 1, node.body[0].lineno - 1, node.end_lineno
        if body_start <= start:  # a one-line ``def f(): ...``: nothing to complete
            continue
        header = "".join(lines[start:body_start])
        limit = min(_MAX_BODY_LINES, end - body_start - 1)  # always leave a line to write
        prefixes = []
        for k in range(max(0, limit) + 1):
            prefix = "".join(lines[start : body_start + k])
            if len(prefix) <= _MAX_PREFIX_CHARS and _compiles(prefix) > 0.0:
                prefixes.append(prefix)
        if prefixes:
            out.append(_Function(header, tuple(prefixes), "".join(lines[start:end])))
    return out


@functools.cache
def _code_pools() -> dict[str, tuple[_Function, ...]]:
    seen, pools = set(), {s: [] for s in SPLITS}
    for module in CODE_MODULES:
        source = _module_source(module)
        if source is None:
            continue
        for fn in _functions(source):
            if fn.prefixes in seen:
                continue
            seen.add(fn.prefixes)
            pools["heldout" if _is_heldout(fn.key, 5) else "train"].append(fn)
    return {s: tuple(p) for s, p in pools.items()}


class CodeDomain(Domain):
    """Complete the start of a standard-library function so that it compiles (:func:`code_reward`)."""

    name = "code"

    def reward(self, data: Mapping, answer: Answer) -> float:
        return code_reward(data, answer)

    def _pool(self, split: str) -> Sequence[_Function]:
        return _code_pools()[split]

    def _make(self, item: _Function, tier: str, rng: random.Random) -> tuple[list[dict], dict]:
        prefix = rng.choice(item.prefixes)
        return [{"role": "user", "content": CODE_PROMPT + prefix}], {"prefix": prefix}


# ---- tool_args


TOOL_CALLABLES = (
    "textwrap.indent textwrap.dedent textwrap.TextWrapper math.isclose math.comb math.perm math.copysign "
    "math.ldexp builtins.round builtins.divmod builtins.pow builtins.abs fnmatch.fnmatch fnmatch.fnmatchcase "
    "fnmatch.translate posixpath.splitext posixpath.relpath posixpath.basename posixpath.dirname "
    "posixpath.normpath posixpath.isabs posixpath.commonprefix shlex.quote shlex.split shlex.join html.escape "
    "html.unescape colorsys.rgb_to_hsv colorsys.hsv_to_rgb colorsys.rgb_to_hls colorsys.hls_to_rgb "
    "colorsys.rgb_to_yiq colorsys.yiq_to_rgb bisect.bisect_left bisect.bisect_right calendar.monthrange "
    "calendar.isleap calendar.leapdays calendar.weekday calendar.monthcalendar statistics.median statistics.mean "
    "statistics.stdev difflib.get_close_matches difflib.unified_diff string.capwords heapq.nlargest heapq.nsmallest"
).split()

_STRINGS = {"type": "array", "items": {"type": "string"}}
_NUMBERS = {"type": "array", "items": {"type": "number"}}
_COLOR_FUNCTIONS = ("rgb_to_hsv", "hsv_to_rgb", "rgb_to_hls", "hls_to_rgb", "rgb_to_yiq", "yiq_to_rgb")
# Parameters whose type no default tells: a JSON type name or a schema. An optional parameter listed
# here with a None default becomes ``[type, "null"]``; one not listed accepts anything.
TOOL_PARAM_TYPES: dict[str, dict[str, str | dict]] = {
    "textwrap.indent": {"text": "string", "prefix": "string"},
    "textwrap.dedent": {"text": "string"},
    "textwrap.TextWrapper": {"max_lines": "integer"},
    "math.isclose": {"a": "number", "b": "number"},
    "math.comb": {"n": "integer", "k": "integer"},
    "math.perm": {"n": "integer", "k": "integer"},
    "math.copysign": {"x": "number", "y": "number"},
    "math.ldexp": {"x": "number", "i": "integer"},
    "builtins.round": {"number": "number", "ndigits": "integer"},
    "builtins.divmod": {"x": "number", "y": "number"},
    "builtins.pow": {"base": "number", "exp": "number", "mod": "integer"},
    "builtins.abs": {"x": "number"},
    "fnmatch.fnmatch": {"name": "string", "pat": "string"},
    "fnmatch.fnmatchcase": {"name": "string", "pat": "string"},
    "fnmatch.translate": {"pat": "string"},
    "posixpath.splitext": {"p": "string"},
    "posixpath.relpath": {"path": "string", "start": "string"},
    "posixpath.basename": {"p": "string"},
    "posixpath.dirname": {"p": "string"},
    "posixpath.normpath": {"path": "string"},
    "posixpath.isabs": {"s": "string"},
    "posixpath.commonprefix": {"m": _STRINGS},
    "shlex.quote": {"s": "string"},
    "shlex.split": {"s": "string"},
    "shlex.join": {"split_command": _STRINGS},
    "html.escape": {"s": "string"},
    "html.unescape": {"s": "string"},
    **{f"colorsys.{f}": dict.fromkeys(f[:3], "number") for f in _COLOR_FUNCTIONS},  # (r, g, b), (h, s, v), ...
    "bisect.bisect_left": {"a": _NUMBERS, "x": "number", "hi": "integer"},
    "bisect.bisect_right": {"a": _NUMBERS, "x": "number", "hi": "integer"},
    "calendar.monthrange": {"year": "integer", "month": "integer"},
    "calendar.isleap": {"year": "integer"},
    "calendar.leapdays": {"y1": "integer", "y2": "integer"},
    "calendar.weekday": {"year": "integer", "month": "integer", "day": "integer"},
    "calendar.monthcalendar": {"year": "integer", "month": "integer"},
    "statistics.median": {"data": _NUMBERS},
    "statistics.mean": {"data": _NUMBERS},
    "statistics.stdev": {"data": _NUMBERS, "xbar": "number"},
    "difflib.get_close_matches": {"word": "string", "possibilities": _STRINGS},
    "difflib.unified_diff": {"a": _STRINGS, "b": _STRINGS},
    "string.capwords": {"s": "string", "sep": "string"},
    "heapq.nlargest": {"n": "integer", "iterable": _NUMBERS},
    "heapq.nsmallest": {"n": "integer", "iterable": _NUMBERS},
}
_DEFAULT_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))  # bool before int


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable offered as a tool: ``name`` (qualified), ``description``, ``schema`` (JSON schema)."""

    name: str
    description: str
    schema: dict


def _param_schema(name: str, param: inspect.Parameter) -> dict:
    table = TOOL_PARAM_TYPES.get(name, {})
    given = table.get(param.name)
    given = {"type": given} if isinstance(given, str) else given
    if param.default is inspect.Parameter.empty:
        if given is None:
            raise ValueError(f"TOOL_PARAM_TYPES[{name!r}] lacks the required parameter {param.name!r}")
        return copy.deepcopy(given)
    if param.default is None:
        if given is None:
            return {}
        if isinstance(given.get("type"), str) and set(given) == {"type"}:
            return {"type": [given["type"], "null"]}
        return {"anyOf": [copy.deepcopy(given), {"type": "null"}]}
    for cls, json_type in _DEFAULT_TYPES:
        if isinstance(param.default, cls):
            return {"type": json_type}
    raise ValueError(f"{name}: parameter {param.name!r} has a default of unsupported type {type(param.default)}")


def tool_for(name: str) -> Tool | None:
    """The tool of the callable ``module.attr``; None if it takes ``*args`` or ``**kwargs``."""
    module, _, attr = name.rpartition(".")
    obj = getattr(importlib.import_module(module), attr)
    sig = inspect.signature(obj)
    kinds = {p.kind for p in sig.parameters.values()}
    if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None
    params = [p for p in sig.parameters.values() if p.name != "self"]
    schema = {
        "type": "object",
        "properties": {p.name: _param_schema(name, p) for p in params},
        "required": [p.name for p in params if p.default is inspect.Parameter.empty],
        "additionalProperties": False,
    }
    doc = (inspect.getdoc(obj) or "").strip()
    description = doc.splitlines()[0].strip() if doc else f"{name}{sig}"
    display = name.removeprefix("builtins.")
    return Tool(display, description, schema)


@functools.cache
def _tool_pools() -> dict[str, tuple[Tool, ...]]:
    pools = {s: [] for s in SPLITS}
    for name in TOOL_CALLABLES:
        tool = tool_for(name)
        if tool is not None:
            pools["heldout" if _is_heldout(tool.name, 4) else "train"].append(tool)
    return {s: tuple(p) for s, p in pools.items()}


def tools(split: str) -> tuple[Tool, ...]:
    """The tools of ``split`` (``"train"`` or ``"heldout"``)."""
    if split not in SPLITS:
        raise ValueError(f"split is {split!r}; allowed: {', '.join(SPLITS)}")
    return _tool_pools()[split]


class ToolArgsDomain(Domain):
    """Write the JSON arguments of a call to a standard-library callable (:func:`tool_args_reward`)."""

    name = "tool_args"

    def reward(self, data: Mapping, answer: Answer) -> float:
        return tool_args_reward(data, answer)

    def _pool(self, split: str) -> Sequence[Tool]:
        return tools(split)

    def _make(self, item: Tool, tier: str, rng: random.Random) -> tuple[list[dict], dict]:
        system = (
            f"You can call the tool {item.name}.\nDescription: {item.description}\n"
            f"Parameters (JSON schema): {json.dumps(item.schema, sort_keys=True)}"
        )
        user = f"Reply with only the JSON object of arguments for a call to {item.name}."
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return messages, {"name": item.name, "schema": copy.deepcopy(item.schema)}


# ---- budget


# Short generic questions, each ending in "?" (the split point), several to a line.
BUDGET_QUESTIONS = tuple(
    q.strip() + "?"
    for q in """
What does `zip` return? What does `enumerate` return? What is the difference between a list and a tuple?
How do you reverse a list in Python? What does `len` do? What is a dictionary?
How do you open a file for reading? What does the `with` statement do? What is a generator?
What does `yield` do? What is the difference between `is` and `==`? What does `None` mean?
How do you copy a list? What does `sorted` return? What does `str.join` do? What does `str.split` do?
What is a lambda? What does `range(3)` produce? What is an exception? How do you catch an exception?
What does `raise` do? What is a class? What does `self` refer to in a method? What does `__init__` do?
What is a module? What does `import` do? What is a set? How do you remove duplicates from a list?
What does `map` return? What does `filter` return? What is a decorator? What does `isinstance` check?
What is the difference between `append` and `extend`? What does `dict.get` return for a missing key?
What does `pass` do? What is a list comprehension? What does `break` do in a loop?
What does `continue` do in a loop? What is recursion? What does `return` do without a value?
What is an f-string? What does `any` return for an empty list?
""".split("?")
    if q.strip()
)


class BudgetDomain(Domain):
    """Answer a short question, closing thinking before the tier's budget (:func:`budget_reward`)."""

    name = "budget"

    def reward(self, data: Mapping, answer: Answer) -> float:
        return budget_reward(data, answer)

    def _pool(self, split: str) -> Sequence[str]:
        return tuple(q for q in BUDGET_QUESTIONS if _is_heldout(q, 4) == (split == "heldout"))

    def _make(self, item: str, tier: str, rng: random.Random) -> tuple[list[dict], dict]:
        return [{"role": "user", "content": item}], {}


DOMAINS: dict[str, Domain] = {"code": CodeDomain(), "tool_args": ToolArgsDomain(), "budget": BudgetDomain()}


def get_domains(names: Sequence[str]) -> list[Domain]:
    """The domains named, in order.

    Raises:
      ValueError: a name is not a key of :data:`DOMAINS` (the error names it and lists the allowed).
    """
    if isinstance(names, str):
        names = [names]
    out = []
    for name in names:
        if name not in DOMAINS:
            raise ValueError(f"unknown domain {name!r}; allowed: {', '.join(sorted(DOMAINS))}")
        out.append(DOMAINS[name])
    return out
