"""Grammars that constrain decoding: bounded JSON schemas, the tool-call and JSON grammars, a matcher.

A forced tool call or a ``json_schema`` answer must finish within the tokens a request has left,
whatever the model prefers. A JSON schema alone does not promise that (a string may run on
forever), so :func:`bounded_schema` rewrites a schema of the supported subset into one whose
every value has a bounded size: strings get a ``maxLength``, arrays a ``maxItems``, numbers a
range and a number of decimals, objects no keys beyond ``properties``, and the JSON is compact (no
whitespace). The caps are the largest rung of a fixed ladder (:data:`LEVELS`) whose worst case
fits the budget. Each cap only narrows what the original schema allows, so anything generated
validates against the original.

The worst case is counted in bytes, which bounds tokens: every non-special token of a byte-level
BPE vocabulary is at least one byte. A string character is at most 4 bytes (UTF-8; ``\\uXXXX``, 6
bytes, is not among the escapes allowed; llguidance counts ``maxLength`` in code points).

Supported keywords: ``type`` (object, string, integer, number, boolean, array, null, or a list of
them), ``properties``, ``required``, ``additionalProperties`` (false or absent: generation adds no
other keys either way), ``enum`` / ``const`` (strings, integers, booleans, null), ``minLength`` /
``maxLength``, ``items`` / ``minItems`` / ``maxItems``, ``minimum`` / ``maximum``, and annotations
that do not constrain (``description``, ``title``, ``default``, ``examples``, ``$comment``,
``$schema``). Anything else is a ValueError naming the keyword and where it is.
"""

from __future__ import annotations

import dataclasses
import decimal
import json
import math
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from jaxmoe.chat.format import EOS_TOKEN

TYPES = ("object", "string", "integer", "number", "boolean", "array", "null")
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "$schema"})
_KEYWORDS = (
    frozenset(
        {"type", "properties", "required", "additionalProperties", "enum", "const", "minLength", "maxLength"}
        | {"items", "minItems", "maxItems", "minimum", "maximum"}
    )
    | _ANNOTATIONS
)
BYTES_PER_CHAR = 4  # a UTF-8 character, or a two-byte escape such as \n
# Compact JSON; no \uXXXX escapes, so a character stays within BYTES_PER_CHAR.
X_GUIDANCE = {"whitespace_flexible": False, "json_allowed_escapes": 'nrbtf\\"'}
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_ENUM_INT = 2**53  # exactly representable, so llguidance writes it as Python does


@dataclasses.dataclass(frozen=True)
class Caps:
    """One rung of the ladder: the sizes a bounded schema allows where the schema leaves them open.

    A schema's own smaller ``maxLength`` / ``maxItems`` / range is kept; its ``minLength`` /
    ``minItems`` win over a smaller cap.
    """

    chars: int  # longest string
    items: int  # longest array
    int_digits: int  # |integer| < 10**int_digits
    num_digits: int  # |number| <= 10**num_digits - 1 ...
    decimals: int  # ... in steps of 10**-decimals (digits + decimals <= 12: exact as float64)


LEVELS = (
    Caps(64, 8, 15, 6, 6),
    Caps(48, 8, 12, 6, 6),
    Caps(32, 6, 9, 6, 4),
    Caps(24, 5, 9, 5, 3),
    Caps(16, 4, 6, 4, 3),
    Caps(12, 3, 6, 4, 2),
    Caps(8, 2, 4, 3, 2),
    Caps(4, 2, 3, 3, 1),
    Caps(2, 1, 2, 2, 1),
    Caps(0, 0, 1, 1, 0),
)


# --- tokenizer tables --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTables:
    """What constrained decoding needs of one tokenizer, built once (:func:`token_tables`).

    Attributes:
      llg: the llguidance tokenizer.
      vocab_size: the tokenizer's vocabulary, added tokens included.
      special_ids: ids of the special (added) tokens.
      eos_id: the end-of-text id.
      text: bool ``[vocab_size]``: the plain-text tokens (every id that is not special).
      token_id: the id of a token string, None if absent.
    """

    llg: llguidance.LLTokenizer
    vocab_size: int
    special_ids: frozenset[int]
    eos_id: int
    text: np.ndarray
    token_id: Callable[[str], int | None]
    _masks: dict = dataclasses.field(default_factory=dict, repr=False)

    def mask(
        self, vocab_size: int, ids: Sequence[int] = (), *, text: bool = False, not_text: Sequence[int] = ()
    ) -> np.ndarray:
        """Read-only bool ``[vocab_size]`` (cached): ``ids``, and if ``text`` the text tokens but
        ``not_text`` (markup that a tokenizer does not mark special, e.g. an imported ``<think>``)."""
        key = (vocab_size, tuple(sorted(ids)), text, tuple(sorted(not_text)) if text else ())
        out = self._masks.get(key)
        if out is None:
            out = np.zeros(vocab_size, bool)
            if text:
                out[: self.vocab_size] = self.text
                out[list(key[3])] = False
            out[list(key[1])] = True
            out.flags.writeable = False
            self._masks[key] = out
        return out


_TABLES: dict[int, tuple[Any, TokenTables]] = {}
_TABLES_LOCK = threading.Lock()


def _build_tables(tokenizer) -> TokenTables:
    if hasattr(tokenizer, "to_json_str"):  # jaxmoe.chat.tokenizer.Tokenizer
        json_str, vocab_size = tokenizer.to_json_str(), tokenizer.vocab_size
        special, eos_id, token_id = frozenset(tokenizer.special_ids), tokenizer.eos_id, tokenizer.token_id
    else:  # a tokenizers.Tokenizer
        json_str, vocab_size = tokenizer.to_str(), tokenizer.get_vocab_size(with_added_tokens=True)
        special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        token_id = tokenizer.token_to_id
        eos_id = token_id(EOS_TOKEN)
        eos_id = 0 if eos_id is None else eos_id
    llg = llguidance.LLTokenizer(json_str, n_vocab=vocab_size, eos_token=eos_id)
    text = np.ones(vocab_size, bool)
    text[list(special)] = False
    text.flags.writeable = False
    return TokenTables(llg, vocab_size, special, eos_id, text, token_id)


def token_tables(tokenizer) -> TokenTables:
    """The :class:`TokenTables` of a tokenizer, built on first use and cached while it lives.

    Args:
      tokenizer: a ``jaxmoe.chat.tokenizer.Tokenizer`` or a ``tokenizers.Tokenizer``.
    """
    key = id(tokenizer)
    with _TABLES_LOCK:
        hit = _TABLES.get(key)
        if hit is not None:
            ref, tables = hit
            if (ref() if isinstance(ref, weakref.ref) else ref) is tokenizer:
                return tables
        tables = _build_tables(tokenizer)
        try:  # the entry goes when the tokenizer does
            ref = weakref.ref(tokenizer, lambda _, key=key, tables=_TABLES: tables.pop(key, None))
        except TypeError:  # not weak-referenceable (a tokenizers.Tokenizer): held for good
            ref = tokenizer
        _TABLES[key] = (ref, tables)
        return tables


def llg_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a tokenizer (cached per tokenizer, see :func:`token_tables`)."""
    return token_tables(tokenizer).llg


# --- bounded schemas ---------------------------------------------------------------------------


def _nonneg_int(schema: dict, key: str, path: str) -> int | None:
    value = schema.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{path}.{key}: must be a non-negative integer, got {value!r}")
    return value


def _number(schema: dict, key: str, path: str) -> decimal.Decimal | None:
    value = schema.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{path}.{key}: must be a finite number, got {value!r}")
    return decimal.Decimal(str(value))


def _literal_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def _check_literal(value: Any, path: str) -> None:
    ok = value is None or isinstance(value, str | bool)
    ok = ok or (isinstance(value, int) and abs(value) < _MAX_ENUM_INT)
    if not ok:
        raise ValueError(
            f"{path}: enum/const values must be strings, integers (|n| < 2**53), booleans or null, got {value!r}"
        )


def _matches_type(value: Any, types: Sequence[str] | None) -> bool:
    if types is None:
        return True
    kind = {type(None): "null", bool: "boolean", str: "string", int: "integer"}[type(value)]
    return kind in types or (kind == "integer" and "number" in types)


def _bound_literals(schema: dict, types, path: str) -> tuple[dict, int]:
    if "const" in schema:
        values = [schema["const"]]
        if "enum" in schema and values[0] not in schema["enum"]:
            raise ValueError(f"{path}: const {values[0]!r} is not in enum")
    else:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path}.enum: must be a non-empty list, got {values!r}")
    for i, v in enumerate(values):
        _check_literal(v, f"{path}.enum[{i}]")
    kept = [v for v in values if _matches_type(v, types)]
    if not kept:
        raise ValueError(f"{path}: no enum/const value is of type {types}")
    return {"enum": kept}, max(_literal_bytes(v) for v in kept)


def _bound_string(schema: dict, caps: Caps, path: str) -> tuple[dict, int]:
    lo, hi = _nonneg_int(schema, "minLength", path) or 0, _nonneg_int(schema, "maxLength", path)
    if hi is not None and hi < lo:
        raise ValueError(f"{path}: maxLength {hi} < minLength {lo}")
    cap = max(min(caps.chars if hi is None else hi, caps.chars), lo)
    out = {"type": "string", "maxLength": cap} | ({"minLength": lo} if lo else {})
    return out, 2 + BYTES_PER_CHAR * cap


def _bound_integer(schema: dict, caps: Caps, path: str) -> tuple[dict, int]:
    umin, umax = _number(schema, "minimum", path), _number(schema, "maximum", path)
    umin = None if umin is None else int(math.ceil(umin))
    umax = None if umax is None else int(math.floor(umax))
    if umin is not None and umax is not None and umin > umax:
        raise ValueError(f"{path}: no integer between minimum and maximum")
    limit = 10**caps.int_digits - 1
    lo, hi = max(-limit, umin if umin is not None else -limit), min(limit, umax if umax is not None else limit)
    if lo > hi:  # the schema's whole range lies beyond the cap: its end nearest zero
        lo = hi = umin if umin is not None and umin > limit else umax
    return {"type": "integer", "minimum": lo, "maximum": hi}, max(len(str(lo)), len(str(hi)))


def _bound_number(schema: dict, caps: Caps, path: str) -> tuple[dict, int]:
    umin, umax = _number(schema, "minimum", path), _number(schema, "maximum", path)
    if umin is not None and umax is not None and umin > umax:
        raise ValueError(f"{path}: minimum > maximum")
    limit = decimal.Decimal(10**caps.num_digits - 1)
    lo, hi = max(-limit, umin if umin is not None else -limit), min(limit, umax if umax is not None else limit)
    if lo > hi:
        lo = hi = umin if umin is not None and umin > limit else umax
    for decimals in range(caps.decimals, 13):  # the fewest decimals >= the cap's with a value in range
        step = decimal.Decimal(1).scaleb(-decimals)
        first, last = (
            (lo / step).to_integral_value(decimal.ROUND_CEILING),
            (hi / step).to_integral_value(decimal.ROUND_FLOOR),
        )
        if first <= last:
            break
    else:
        raise ValueError(f"{path}: no number with at most 12 decimals between minimum and maximum")
    worst = max(len(str(int(abs(v)))) + (v < 0) for v in (first * step, last * step)) + (decimals and 1 + decimals)
    if decimals == 0:
        return {"type": "integer", "minimum": int(first), "maximum": int(last)}, worst
    return {"type": "number", "minimum": float(lo), "maximum": float(hi), "multipleOf": float(step)}, worst


def _bound_object(schema: dict, caps: Caps, path: str) -> tuple[dict, int]:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"{path}.properties: must be an object, got {props!r}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{path}.required: must be a list of property names, got {required!r}")
    if missing := [r for r in required if r not in props]:
        raise ValueError(f"{path}.required: {missing} are not in properties (additional properties are not generated)")
    if schema.get("additionalProperties", False) is not False:
        raise ValueError(f"{path}.additionalProperties: only false (or absent) is supported")
    out, worst = {}, 2 + max(0, len(props) - 1)  # braces and commas
    for name, sub in props.items():
        out[name], w = _bound(sub, caps, f"{path}.properties.{name}")
        worst += _literal_bytes(name) + 1 + w
    bounded = {"type": "object", "properties": out, "additionalProperties": False}
    return bounded | ({"required": list(required)} if required else {}), worst


def _bound_array(schema: dict, caps: Caps, path: str) -> tuple[dict, int]:
    if not isinstance(schema.get("items"), dict):
        raise ValueError(f"{path}.items: an array needs one items schema (an object), got {schema.get('items')!r}")
    lo, hi = _nonneg_int(schema, "minItems", path) or 0, _nonneg_int(schema, "maxItems", path)
    if hi is not None and hi < lo:
        raise ValueError(f"{path}: maxItems {hi} < minItems {lo}")
    cap = max(min(caps.items if hi is None else hi, caps.items), lo)
    items, w = _bound(schema["items"], caps, f"{path}.items")
    out = {"type": "array", "items": items, "maxItems": cap} | ({"minItems": lo} if lo else {})
    return out, 2 + cap * w + max(0, cap - 1)


_BOUND_TYPE = {
    "object": _bound_object,
    "string": _bound_string,
    "integer": _bound_integer,
    "number": _bound_number,
    "array": _bound_array,
    "boolean": lambda s, c, p: ({"type": "boolean"}, 5),
    "null": lambda s, c, p: ({"type": "null"}, 4),
}


def _bound(schema: Any, caps: Caps, path: str) -> tuple[dict, int]:
    """The bounded form of one (sub)schema and its worst case in bytes."""
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a schema must be an object, got {schema!r}")
    for key in schema:
        if key not in _KEYWORDS:
            raise ValueError(f"{path}: unsupported keyword {key!r} (supported: {', '.join(sorted(_KEYWORDS))})")
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if types is not None and (not isinstance(types, list) or not types or any(t not in TYPES for t in types)):
        raise ValueError(f"{path}.type: must be one of {TYPES} or a list of them, got {schema['type']!r}")
    if "enum" in schema or "const" in schema:
        return _bound_literals(schema, types, path)
    if types is None:
        raise ValueError(f"{path}: needs a 'type' (or 'enum' / 'const')")
    branches = [_BOUND_TYPE[t](schema, caps, path) for t in dict.fromkeys(types)]
    if len(branches) == 1:
        return branches[0]
    return {"anyOf": [b for b, _ in branches]}, max(w for _, w in branches)


def bounded_schema(schema: dict, budget_tokens: int, *, path: str = "schema") -> tuple[dict, int]:
    """A finite version of a JSON schema whose worst case fits a token budget.

    Args:
      schema: a JSON schema of the supported subset (see the module docstring).
      budget_tokens: the most tokens the JSON text may take.
      path: where the schema sits in the request, for error messages
        (e.g. ``"tools[0].function.parameters"``).

    Returns:
      ``(bounded, worst_tokens)``: the schema llguidance compiles (with the largest caps of
      :data:`LEVELS` that fit, and ``"x-guidance"`` set for compact JSON) and the most tokens text
      generated under it can take (``<= budget_tokens``).

    Raises:
      ValueError: the schema uses something unsupported (naming the keyword and its path), or even
        the smallest caps do not fit ``budget_tokens``.
    """
    worst = None
    for caps in LEVELS:
        bounded, worst = _bound(schema, caps, path)
        if worst <= budget_tokens:
            return {"x-guidance": dict(X_GUIDANCE)} | bounded, worst
    raise ValueError(
        f"{path}: the schema needs at least {worst} tokens even at the smallest caps; {budget_tokens} are left"
    )


def schema_floor(schema: dict, *, path: str = "schema") -> int:
    """The fewest tokens :func:`bounded_schema` can bound ``schema`` to (its smallest caps)."""
    return _bound(schema, LEVELS[-1], path)[1]


# --- grammars ----------------------------------------------------------------------------------


def tool_name(tool: dict, path: str = "tools[0]") -> str:
    """A tool's name, checked (ValueError naming ``path`` if it is not a valid name)."""
    name = tool.get("name") if isinstance(tool, dict) else None
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ValueError(f"{path}.name: must match {TOOL_NAME.pattern}, got {name!r}")
    return name


def tool_parameters(tool: dict) -> dict:
    """A tool's parameters schema; a tool without one takes no arguments (``{}``)."""
    params = tool.get("parameters")
    return {"type": "object", "properties": {}} if params is None else params


def tool_floor(tool: dict, *, path: str = "tools[0]") -> int:
    """The fewest tokens one call of ``tool`` takes at worst: ``name <args> {json} <close>``."""
    name = tool_name(tool, path)
    return len(name) + 2 + schema_floor(tool_parameters(tool), path=f"{path}.parameters")


def tool_call_grammar(
    tools: Sequence[dict], budget_tokens: int, *, call_args: int, call_close: int, name: str | None = None
) -> tuple[str, int]:
    """The lark grammar of one tool call after its opening token: ``NAME <args> JSON <close>``.

    Each tool's arguments follow its own bounded parameters schema; tools whose smallest call does
    not fit ``budget_tokens`` are left out.

    Args:
      tools: ``{"name", "description", "parameters"}`` dicts.
      budget_tokens: the most tokens the call (name through ``call_close``) may take.
      call_args, call_close: the ids of the markup tokens between name and arguments and after them.
      name: only this tool (a forced call).

    Returns:
      ``(lark, worst_tokens)``.

    Raises:
      ValueError: a tool or its schema is invalid, ``name`` is not a tool, or no call fits.
    """
    names = [tool_name(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if name is not None and name not in names:
        raise ValueError(f"tool_choice: no tool named {name!r} (tools: {names})")
    rules, alternatives, worst = [], [], 0
    for i, (tool, this) in enumerate(zip(tools, names, strict=True)):
        if name is not None and this != name:
            continue
        overhead = len(this) + 2
        path = f"tools[{i}].parameters"
        if overhead + schema_floor(tool_parameters(tool), path=path) > budget_tokens:
            continue
        schema, w = bounded_schema(tool_parameters(tool), budget_tokens - overhead, path=path)
        alternatives.append(f"call_{i}")
        rules.append(f"call_{i}: {json.dumps(this)} <[{call_args}]> args_{i} <[{call_close}]>")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
        worst = max(worst, overhead + w)
    if not alternatives:
        raise ValueError(f"no tool call fits in {budget_tokens} tokens")
    return "\n".join([f"start: {' | '.join(alternatives)}", *rules]) + "\n", worst


def json_grammar(
    schema: dict, budget_tokens: int, *, path: str = "response_format.json_schema.schema"
) -> tuple[str, int]:
    """The lark grammar of one JSON value of ``schema`` bounded to ``budget_tokens``: ``(lark, worst_tokens)``."""
    bounded, worst = bounded_schema(schema, budget_tokens, path=path)
    return f"start: %json {json.dumps(bounded)}\n", worst


# --- matcher -----------------------------------------------------------------------------------


class Matcher:
    """An llguidance matcher over one grammar: the tokens it allows, the tokens it consumed.

    Args:
      tables: the tokenizer's :class:`TokenTables`.
      grammar: lark text (:func:`tool_call_grammar`, :func:`json_grammar`).

    Raises:
      ValueError: the grammar does not compile.
    """

    def __init__(self, tables: TokenTables, grammar: str):
        self._tables = tables
        self._m = llguidance.LLMatcher(tables.llg, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        self._raise_if_error("grammar")
        self._bits = llg_numpy.allocate_token_bitmask(1, tables.llg.vocab_size)

    def _raise_if_error(self, what: str) -> None:
        if self._m.is_error():
            raise ValueError(f"{what}: {self._m.get_error()}")

    def allowed(self, vocab_size: int) -> np.ndarray:
        """Bool ``[vocab_size]``: the tokens the grammar allows next (never end-of-text: see ``done``).

        Raises:
          ValueError: the matcher is in error, or allows nothing while unfinished.
        """
        llg_numpy.fill_next_token_bitmask(self._m, self._bits)
        self._raise_if_error("mask")
        n = self._tables.llg.vocab_size
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:n].astype(bool)
        bits[self._tables.eos_id] = False  # the caller decides how a finished value ends
        if not bits.any() and not self.accepting:
            raise ValueError("mask: the grammar allows no token and is not finished")
        out = np.zeros(vocab_size, bool)
        out[: min(n, vocab_size)] = bits[:vocab_size]
        return out

    def accept(self, token: int) -> None:
        """Consumes one token. Raises ValueError if the grammar does not allow it."""
        if not self._m.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed by the grammar: {self._m.get_error()}")

    @property
    def accepting(self) -> bool:
        """The tokens so far form a complete value (more may still be allowed)."""
        return self._m.is_accepting()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows no further token."""
        return self._m.is_stopped() and not self._m.is_error()
