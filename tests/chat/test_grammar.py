"""Bounded schemas (the supported subset, the caps, an honest worst case), the grammars, the matcher."""

import json

import jsonschema
import numpy as np
import pytest
from decoding_helpers import MARKUP, MODELS, SCHEMAS, TOOLS, model_vocab, pick, preferences, tokenizer

from jaxmoe.chat import grammar


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def tables(tok):
    return grammar.token_tables(tok)


def _ids(tok):
    return {"call_args": tok.token_id(MARKUP["call_args"]), "call_close": tok.token_id(MARKUP["call_close"])}


def _generate(tables, lark, model, seed, limit=2000):
    """Tokens a model generates under a grammar until it is done (or ends a complete value)."""
    m, rng, out = grammar.Matcher(tables, lark), np.random.default_rng(seed), []
    logits = preferences(model)
    for _ in range(limit):
        if m.done:
            return out
        mask = m.allowed(model_vocab())
        if m.accepting and (model == "end_now" or rng.random() < 0.1):
            return out
        assert mask.any() and not mask[tables.vocab_size :].any()
        markup = {tables.token_id(MARKUP["call_args"]), tables.token_id(MARKUP["call_close"])}
        assert set(np.nonzero(mask)[0]) & tables.special_ids <= markup  # no other special token
        t = pick(mask, logits, rng)
        m.accept(t)
        out.append(t)
    raise AssertionError("the grammar did not finish")


# --- tokenizer tables ---------------------------------------------------------------------------


def test_tables_are_cached_and_take_either_tokenizer(tok, tables):
    assert grammar.token_tables(tok) is tables and grammar.llg_tokenizer(tok) is tables.llg
    hf = grammar.token_tables(tok.hf)  # a bare tokenizers.Tokenizer works too
    assert grammar.token_tables(tok.hf) is hf
    assert (hf.vocab_size, hf.special_ids, hf.eos_id) == (tok.vocab_size, tok.special_ids, tok.eos_id)
    assert np.array_equal(hf.text, tables.text)
    assert tables.llg.vocab_size == tok.vocab_size
    assert not tables.text[sorted(tok.special_ids)].any() and tables.text.sum() == tok.vocab_size - len(tok.special_ids)


def test_every_token_a_grammar_may_allow_is_at_least_one_byte(tables):
    """The worst case counts bytes: sound only if no token a grammar allows is empty. The one empty
    text token is the byte 0xFF (llguidance's marker of special tokens, never in UTF-8 text)."""
    llg = tables.llg
    empty = [i for i in np.nonzero(tables.text)[0] if not llg.decode_bytes([int(i)])]
    assert all(llg.is_special_token(int(i)) for i in empty)
    m = grammar.Matcher(tables, grammar.json_grammar({"type": "string"}, 10_000)[0])
    (quote,) = tokenizer().encode('"')
    m.accept(quote)  # inside a string: any text but the empty tokens
    assert not m.allowed(model_vocab())[empty].any() and m.allowed(model_vocab()).sum() > 100


def test_static_masks(tables):
    m = tables.mask(20 + tables.vocab_size, [3, 5], text=True)
    assert m is tables.mask(20 + tables.vocab_size, [5, 3], text=True) and not m.flags.writeable
    assert m[3] and m[5] and not m[tables.vocab_size :].any() and not m[tables.eos_id]
    assert tables.mask(600, [7]).sum() == 1


# --- bounded_schema: the subset -----------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, message",
    [
        (
            {"type": "object", "properties": {"x": {"type": "string", "pattern": "a+"}}},
            "properties.x: unsupported keyword 'pattern'",
        ),
        ({"type": "string", "format": "date"}, "unsupported keyword 'format'"),
        ({"anyOf": [{"type": "string"}]}, "unsupported keyword 'anyOf'"),
        ({"$ref": "#/$defs/a"}, "unsupported keyword '$ref'"),
        ({"type": "integer", "exclusiveMinimum": 0}, "unsupported keyword 'exclusiveMinimum'"),
        ({"type": "object", "properties": {}, "additionalProperties": True}, "additionalProperties: only false"),
        ({"type": "object", "additionalProperties": {"type": "string"}}, "additionalProperties: only false"),
        (
            {"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]},
            "required: ['b'] are not in properties",
        ),
        ({"type": "array"}, ".items: an array needs one items schema"),
        ({"type": "array", "items": [{"type": "string"}]}, ".items: an array needs one items schema"),
        ({"description": "anything"}, "needs a 'type'"),
        ({"type": "date"}, ".type: must be one of"),
        ({"type": []}, ".type: must be one of"),
        ({"enum": [1.5]}, "enum[0]: enum/const values must be"),
        ({"enum": [{"a": 1}]}, "enum[0]: enum/const values must be"),
        ({"enum": []}, ".enum: must be a non-empty list"),
        ({"type": "integer", "enum": ["a"]}, "no enum/const value is of type"),
        ({"const": "a", "enum": ["b"]}, "const 'a' is not in enum"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "maxLength 2 < minLength 5"),
        ({"type": "string", "maxLength": -1}, ".maxLength: must be a non-negative integer"),
        ({"type": "array", "items": {"type": "null"}, "maxItems": 1.5}, ".maxItems: must be a non-negative integer"),
        ({"type": "integer", "minimum": 3, "maximum": 2}, "no integer between minimum and maximum"),
        ({"type": "integer", "minimum": 2.2, "maximum": 2.8}, "no integer between minimum and maximum"),
        ({"type": "number", "minimum": "0"}, ".minimum: must be a finite number"),
        ({"type": "object", "properties": {"a": True}}, "properties.a: a schema must be an object"),
    ],
)
def test_unsupported_schemas_name_the_keyword_and_path(schema, message):
    path = "tools[0].function.parameters"
    with pytest.raises(ValueError, match="^" + path.replace("[", r"\[").replace("]", r"\]")) as err:
        grammar.bounded_schema(schema, 10_000, path=path)
    assert message in str(err.value)


def test_the_error_names_the_nested_path():
    schema = {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "string", "pattern": "."}}}}
    with pytest.raises(
        ValueError, match=r"^tools\[0\]\.function\.parameters\.properties\.x\.items: unsupported keyword 'pattern'"
    ):
        grammar.bounded_schema(schema, 1000, path="tools[0].function.parameters")


def test_a_budget_below_the_smallest_caps_is_an_error():
    floor = grammar.schema_floor(SCHEMAS["records"])
    assert grammar.bounded_schema(SCHEMAS["records"], floor)[1] == floor
    with pytest.raises(
        ValueError, match=f"needs at least {floor} tokens even at the smallest caps; {floor - 1} are left"
    ):
        grammar.bounded_schema(SCHEMAS["records"], floor - 1)


# --- bounded_schema: the caps -------------------------------------------------------------------


def test_caps_are_the_largest_that_fit():
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string"}, "a": {"type": "array", "items": {"type": "integer"}}},
    }
    bounded, worst = grammar.bounded_schema(schema, 10_000)
    top = grammar.LEVELS[0]
    assert bounded["x-guidance"] == {"whitespace_flexible": False, "json_allowed_escapes": 'nrbtf\\"'}
    assert bounded["additionalProperties"] is False
    assert bounded["properties"]["s"] == {"type": "string", "maxLength": top.chars}
    assert bounded["properties"]["a"]["maxItems"] == top.items
    assert bounded["properties"]["a"]["items"] == {"type": "integer", "minimum": -(10**15 - 1), "maximum": 10**15 - 1}
    # {"s":"<64 x 4 bytes>","a":[8 x 16-byte integers with commas]}
    assert worst == 2 + (4 + 2 + 4 * 64) + 1 + (4 + 2 + 8 * 16 + 7)
    previous = worst
    for budget in range(worst - 1, 0, -7):  # a smaller budget: smaller caps, a worst case that fits
        try:
            _, w = grammar.bounded_schema(schema, budget)
        except ValueError:
            assert budget < grammar.schema_floor(schema)
            break
        assert w <= budget and w <= previous
        previous = w


def test_the_schema_own_bounds_are_kept():
    schema = {
        "type": "object",
        "properties": {
            "short": {"type": "string", "maxLength": 3},
            "long": {"type": "string", "minLength": 100},  # above every cap: kept
            "few": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
            "n": {"type": "integer", "minimum": 5, "maximum": 7},
            "big": {"type": "integer", "minimum": 10**20},  # beyond the cap: its end nearest zero
            "x": {"type": "number", "minimum": -0.5, "maximum": 2.5},
            "anything": {"type": ["string", "null"], "description": "ignored", "title": "t", "default": None},
        },
    }
    props = grammar.bounded_schema(schema, 10_000)[0]["properties"]
    assert props["short"] == {"type": "string", "maxLength": 3}
    assert props["long"] == {"type": "string", "maxLength": 100, "minLength": 100}
    assert props["few"] == {"type": "array", "items": {"type": "boolean"}, "maxItems": 2, "minItems": 1}
    assert props["n"] == {"type": "integer", "minimum": 5, "maximum": 7}
    assert props["big"] == {"type": "integer", "minimum": 10**20, "maximum": 10**20}
    assert props["x"] == {"type": "number", "minimum": -0.5, "maximum": 2.5, "multipleOf": 1e-06}
    assert props["anything"] == {"anyOf": [{"type": "string", "maxLength": 64}, {"type": "null"}]}


# Budgets below a schema's smallest output are refused elsewhere; here every pair that fits.
FITTING = [(n, b) for n in sorted(SCHEMAS) for b in (60, 150, 400) if grammar.schema_floor(SCHEMAS[n]) <= b]


@pytest.mark.parametrize("name, budget", FITTING)
def test_the_worst_case_holds_against_adversaries(tables, name, budget):
    """Whatever the model prefers, the JSON takes at most the worst case and validates."""
    schema = SCHEMAS[name]
    lark, worst = grammar.json_grammar(schema, budget)
    assert worst <= budget
    llg = tables.llg
    for model in MODELS:
        for seed in range(2 if model != "random" else 6):
            out = _generate(tables, lark, model, seed)
            assert len(out) <= len(llg.decode_bytes(out)) <= worst
            jsonschema.validate(json.loads(llg.decode_bytes(out)), schema)


def test_numbers_stay_in_range_and_digits(tables):
    schema = {"type": "number", "minimum": -999.5, "maximum": 0.25}
    assert grammar.json_grammar(schema, 10_000)[1] == len("-999.500000")  # 6 decimals
    lark, worst = grammar.json_grammar(schema, 6)  # the caps with 1 decimal (and |x| <= 999)
    assert worst == len("-999.0")
    for model in ("digits", "longest", "random"):
        for seed in range(10):
            out = _generate(tables, lark, model, seed)
            value = json.loads(tables.llg.decode_bytes(out))
            assert -999.5 <= value <= 0.25 and len(tables.llg.decode_bytes(out)) <= worst


# --- grammars and the matcher -------------------------------------------------------------------


def _call(tables, lark, model, seed):
    out = _generate(tables, lark, model, seed)
    tok = tokenizer()
    name_ids = out[: out.index(tok.token_id(MARKUP["call_args"]))]
    args = out[len(name_ids) + 1 : -1]
    assert out[-1] == tok.token_id(MARKUP["call_close"])
    return tok.decode(name_ids), json.loads(tok.decode(args)), len(out)


def test_tool_call_grammar(tok, tables):
    lark, worst = grammar.tool_call_grammar(TOOLS, 400, **_ids(tok))
    assert lark.startswith("start: call_0 | call_1 | call_2 | call_3\n")
    seen = set()
    for model in MODELS:
        for seed in range(3):
            name, args, n = _call(tables, lark, model, seed)
            tool = next(t for t in TOOLS if t["name"] == name)
            jsonschema.validate(args, tool.get("parameters", {"type": "object", "additionalProperties": False}))
            assert n <= worst
            seen.add(name)
    assert len(seen) > 1  # the models pick different tools
    lark, worst = grammar.tool_call_grammar(TOOLS, 400, **_ids(tok), name="ping")
    assert _call(tables, lark, "longest", 0)[:2] == ("ping", {}) and worst == len("ping") + 2 + 2


def test_tools_that_do_not_fit_are_left_out(tok):
    small = grammar.tool_floor(TOOLS[0])
    lark, worst = grammar.tool_call_grammar(TOOLS, small, **_ids(tok))
    assert "get_weather" in lark and "records" not in lark and worst <= small
    with pytest.raises(ValueError, match="no tool call fits in 3 tokens"):
        grammar.tool_call_grammar(TOOLS, 3, **_ids(tok))


@pytest.mark.parametrize(
    "tools, name, message",
    [
        ([{"name": "bad name"}], None, r"tools\[0\]\.name: must match"),
        ([{"description": "no name"}], None, r"tools\[0\]\.name: must match"),
        (
            [{"name": "t", "parameters": {"type": "string", "pattern": "x"}}],
            None,
            r"tools\[0\]\.parameters: unsupported",
        ),
        (TOOLS, "nope", "tool_choice: no tool named 'nope'"),
    ],
)
def test_tool_call_grammar_errors(tok, tools, name, message):
    with pytest.raises(ValueError, match=message):
        grammar.tool_call_grammar(tools, 400, **_ids(tok), name=name)


def test_matcher_refuses_what_the_grammar_does_not_allow(tok, tables):
    m = grammar.Matcher(tables, grammar.json_grammar({"type": "boolean"}, 10)[0])
    allowed = m.allowed(model_vocab())
    assert allowed.shape == (model_vocab(),) and allowed.dtype == bool and not allowed[tok.eos_id]
    assert not m.accepting and not m.done
    (bad,) = tok.encode("7")
    assert not allowed[bad]
    with pytest.raises(ValueError, match=f"token {bad} is not allowed by the grammar"):
        m.accept(bad)
    m = grammar.Matcher(tables, grammar.json_grammar({"type": "boolean"}, 10)[0])
    for t in tok.encode("true"):
        m.accept(t)
    assert m.accepting and m.done and not m.allowed(model_vocab()).any()
    with pytest.raises(ValueError, match="grammar"):
        grammar.Matcher(tables, "start: nonsense_rule\n")
