"""ChatDecoding against adversarial models: forced calls and JSON answers always complete and validate."""

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
from decoding_helpers import MARKUP, MODELS, SCHEMAS, TOOLS, model_vocab, pick, preferences, tokenizer

from jaxmoe.chat import grammar
from jaxmoe.chat.decoding import ChatDecoding, MarkupIds, Phase

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    return {name: tok.token_id(s) for name, s in MARKUP.items()}


def _decoding(**kwargs) -> ChatDecoding:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return ChatDecoding(tokenizer(), vocab_size=model_vocab(), **kwargs)


def _drive(dec: ChatDecoding, model: str, seed: int, logits=None, ends=None) -> list[int]:
    """Runs the engine's loop: mask the model's logits, take its choice, until an end token or max_tokens."""
    tok, rng = tokenizer(), np.random.default_rng(seed)
    logits = preferences(model) if logits is None else logits
    ends = {tok.token_id(MARKUP["end"]), tok.eos_id} if ends is None else ends
    out = []
    while dec.tokens_left > 0:
        mask = dec.allowed()
        assert mask.shape == (model_vocab(),) and mask.dtype == bool and mask.any()
        assert not mask[tok.vocab_size :].any()
        t = pick(mask, logits, rng)
        dec.accept(t)
        out.append(t)
        if t in ends:
            break
    return out


def _split(out: list[int], ids: dict, thinking: bool) -> dict:
    """The turn's parts: reasoning ids, content ids, calls as (name, arguments text), the end token."""
    parts = {"reasoning": [], "content": [], "calls": [], "end": None}
    i = 0
    if thinking:
        close = out.index(ids["think_close"]) if ids["think_close"] in out else len(out)
        parts["reasoning"], i = out[:close], close + 1
    while i < len(out):
        t = out[i]
        if t == ids["call_open"]:
            a, c = out.index(ids["call_args"], i), out.index(ids["call_close"], i)
            parts["calls"].append((out[i + 1 : a], out[a + 1 : c]))
            i = c + 1
        elif t in (ids["end"], ids["eos"]):
            parts["end"] = t
            assert i == len(out) - 1
            i += 1
        else:
            assert not parts["calls"], "text after a call"
            parts["content"].append(t)
            i += 1
    tok = tokenizer()
    for key in ("reasoning", "content"):
        assert not set(parts[key]) & tok.special_ids, f"a special token in the {key}"
    parts["calls"] = [(tok.decode(n), tok.decode(a)) for n, a in parts["calls"]]
    return parts


def _check_calls(parts: dict, allowed_names) -> None:
    for name, args in parts["calls"]:
        assert name in allowed_names
        tool = next(t for t in TOOLS if t["name"] == name)
        jsonschema.validate(json.loads(args), tool.get("parameters", {"type": "object", "additionalProperties": False}))


# --- the completion guarantee --------------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, 0, 17, 150, 300])
@pytest.mark.parametrize("choice", ["required", "get_weather", "search", "records", "ping"])
def test_a_forced_call_always_completes_and_validates(ids, budget, choice):
    tool_choice = "required" if choice == "required" else {"name": choice}
    names = [t["name"] for t in TOOLS] if choice == "required" else [choice]
    for model in MODELS:
        for seed in range(3 if model == "random" else 1):
            dec = _decoding(thinking_budget=budget, tools=TOOLS, tool_choice=tool_choice)
            out = _drive(dec, model, seed)
            parts = _split(out, ids, budget is not None)
            assert len(out) <= MAX_TOKENS and out[-2:] == [ids["call_close"], parts["end"]]
            assert parts["calls"] and not parts["content"] and dec.phase is Phase.DONE
            assert dec.reasoning_tokens == len(parts["reasoning"]) <= (budget or 0)
            _check_calls(parts, names)
            if choice != "required":
                assert len(parts["calls"]) == 1  # a named tool is called once


@pytest.mark.parametrize("budget", [None, 0, 100, 300])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_json_answer_always_completes_and_validates(ids, tok, budget, name):
    for model in MODELS:
        for seed in range(3 if model == "random" else 1):
            dec = _decoding(thinking_budget=budget, response_schema=SCHEMAS[name])
            out = _drive(dec, model, seed)
            parts = _split(out, ids, budget is not None)
            assert len(out) <= MAX_TOKENS and parts["end"] is not None and not parts["calls"]
            assert dec.reasoning_tokens <= (budget or 0)
            jsonschema.validate(json.loads(tok.decode(parts["content"])), SCHEMAS[name])


def test_max_tokens_too_small_for_a_forced_call_or_the_json_is_an_error():
    floor = grammar.tool_floor(TOOLS[2])
    _decoding(max_tokens=floor + 2, tools=TOOLS, tool_choice={"name": "records"})  # call_open + call + end
    with pytest.raises(ValueError, match=f"max_tokens: {floor + 1} cannot hold a forced tool call"):
        _decoding(max_tokens=floor + 1, tools=TOOLS, tool_choice={"name": "records"})
    with pytest.raises(ValueError, match=f"max_tokens: {floor + 2} cannot hold .* at least {floor + 3}"):
        _decoding(max_tokens=floor + 2, tools=TOOLS, tool_choice={"name": "records"}, thinking_budget=10)
    with pytest.raises(ValueError, match="cannot hold the response_format JSON"):
        _decoding(max_tokens=10, response_schema=SCHEMAS["records"])


def test_the_tightest_forced_call_still_completes(ids):
    floor = grammar.tool_floor(TOOLS[2])
    for model in MODELS:
        dec = _decoding(max_tokens=floor + 3, thinking_budget=1000, tools=TOOLS, tool_choice={"name": "records"})
        out = _drive(dec, model, 0)
        assert len(out) <= floor + 3 and out[-2] == ids["call_close"] and dec.phase is Phase.DONE
        _check_calls(_split(out, ids, True), ["records"])


# --- thinking ------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 1, 57, 300, 1000])
def test_thinking_stops_at_the_budget(ids, budget):
    dec = _decoding(thinking_budget=budget)
    out = _drive(dec, "keep_thinking", 0)
    parts = _split(out, ids, True)
    expected = min(budget, MAX_TOKENS - 2)  # room for think_close and one more token
    assert dec.reasoning_tokens == len(parts["reasoning"]) == expected
    assert out[expected] == ids["think_close"]


def test_no_end_of_turn_inside_thinking(ids):
    dec = _decoding(thinking_budget=50)
    assert dec.phase is Phase.THINK
    mask = dec.allowed()
    assert not mask[ids["end"]] and not mask[ids["eos"]] and mask[ids["think_close"]] and not mask[ids["call_open"]]
    assert _drive(dec, "end_now", 0) == [ids["think_close"], ids["end"]] and dec.reasoning_tokens == 0


def test_phases(ids, tok):
    dec = _decoding(thinking_budget=5, tools=TOOLS, tool_choice="auto")
    (a,) = tok.encode("a")
    steps = [
        (a, Phase.THINK),
        (ids["think_close"], Phase.CONTENT),
        (a, Phase.CONTENT),
        (ids["call_open"], Phase.CALL),
        *[(t, Phase.CALL) for t in tok.encode("ping")],
        (ids["call_args"], Phase.CALL),
        *[(t, Phase.CALL) for t in tok.encode("{}")],
        (ids["call_close"], Phase.AFTER_CALL),
        (ids["call_open"], Phase.CALL),
    ]
    for token, phase in steps:
        dec.accept(token)
        assert dec.phase is phase
    assert dec.reasoning_tokens == 1 and dec.tokens_left == MAX_TOKENS - len(steps)
    with pytest.raises(ValueError, match="not allowed in phase call"):
        dec.accept(ids["end"])


# --- tool choice ---------------------------------------------------------------------------------


def test_auto_lets_the_model_choose(ids):
    outcomes = set()
    for model in MODELS:
        for seed in range(4 if model == "random" else 1):
            dec = _decoding(thinking_budget=20, tools=TOOLS, tool_choice="auto")
            out = _drive(dec, model, seed)
            parts = _split(out, ids, True)
            _check_calls(parts, [t["name"] for t in TOOLS])
            assert dec.reasoning_tokens <= 20
            outcomes.add("call" if parts["calls"] else "text" if parts["content"] else "empty")
    assert {"call", "text", "empty"} <= outcomes
    dec = _decoding(tools=TOOLS)  # thinking off: content at once, text, end or a call
    mask = dec.allowed()
    assert mask[ids["call_open"]] and mask[ids["end"]] and mask[ids["eos"]] and mask[tokenizer().encode("x")[0]]
    assert not mask[ids["call_args"]] and not mask[ids["think_close"]] and not mask[ids["user"]]


def test_auto_opens_a_call_only_when_it_fits(ids, tok):
    floor = grammar.tool_floor(TOOLS[3])  # ping: the smallest call
    dec = _decoding(max_tokens=floor + 3, tools=TOOLS)
    (a,) = tok.encode("a")
    assert dec.allowed()[ids["call_open"]]
    dec.accept(a)  # floor + 2 left: call_open, the call and the end still fit
    assert dec.allowed()[ids["call_open"]]
    dec.accept(a)
    assert not dec.allowed()[ids["call_open"]] and dec.allowed()[a]


def test_none_never_calls(ids):
    for model in ("never_end", "random", "longest"):
        for budget in (None, 30):
            dec = _decoding(thinking_budget=budget, tools=TOOLS, tool_choice="none", max_tokens=120)
            rng, logits = np.random.default_rng(0), preferences(model)
            while dec.tokens_left and dec.phase is not Phase.DONE:
                mask = dec.allowed()
                assert not mask[ids["call_open"]]
                dec.accept(pick(mask, logits, rng))
            assert dec.tokens_left == 0 or model != "never_end"


def test_none_ignores_the_tools_schemas():
    bad = [{"name": "t", "parameters": {"type": "string", "pattern": "x"}}]
    _decoding(tools=bad, tool_choice="none")
    with pytest.raises(ValueError, match=r"tools\[0\]\.parameters: unsupported keyword 'pattern'"):
        _decoding(tools=bad, tool_choice="auto")


def test_named_forces_that_tool_even_against_the_model(ids, tok):
    logits = preferences("random").copy()
    logits[tok.encode("search")] = 1e3  # the model wants to call search
    dec = _decoding(tools=TOOLS, tool_choice={"name": "get_weather"})
    parts = _split(_drive(dec, "random", 0, logits=logits), ids, False)
    assert [name for name, _ in parts["calls"]] == ["get_weather"]


def test_parallel_calls_each_validate_and_the_turn_ends_in_time(ids):
    for choice in ("auto", "required"):
        dec = _decoding(tools=TOOLS, tool_choice=choice, thinking_budget=10)
        out = _drive(dec, "never_end", 0)  # always opens another call
        parts = _split(out, ids, True)
        assert len(parts["calls"]) > 2 and len(out) <= MAX_TOKENS and parts["end"] is not None
        _check_calls(parts, [t["name"] for t in TOOLS])


def test_auto_with_a_response_schema_calls_or_answers(ids, tok):
    answers = preferences("end_now").copy()
    answers[ids["call_open"]] = -1e4  # wants to answer, and to end as soon as it may
    for model, logits in (("never_end", None), ("end_now", answers)):
        dec = _decoding(tools=TOOLS, response_schema=SCHEMAS["weather"], thinking_budget=10)
        parts = _split(_drive(dec, model, 0, logits=logits), ids, True)
        if logits is None:
            assert parts["calls"] and not parts["content"]
            _check_calls(parts, [t["name"] for t in TOOLS])
        else:
            assert not parts["calls"]
            jsonschema.validate(json.loads(tok.decode(parts["content"])), SCHEMAS["weather"])


# --- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice: must be one of"),
        ({"tool_choice": {"name": "nope"}, "tools": TOOLS}, "tool_choice.name: 'nope' is not one of the tools"),
        ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools: names must be unique"),
        ({"tools": [{"name": "a b"}]}, r"tools\[0\]\.name: must match"),
        ({"response_schema": {"type": "string", "format": "email"}}, "response_format.json_schema.schema: unsupported"),
        ({"thinking_budget": -1}, "thinking_budget: must be >= 0"),
        ({"max_tokens": 0}, "max_tokens: must be >= 1"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _decoding(**kwargs)
    with pytest.raises(ValueError, match="vocab_size: 100 < the tokenizer's 512"):
        ChatDecoding(tokenizer(), vocab_size=100, max_tokens=10)


def test_markup_ids(tok, ids):
    m = MarkupIds.from_tokenizer(tok)
    assert (m.eos, m.end, m.think_close, m.call_open, m.call_args, m.call_close) == tuple(
        ids[k] for k in ("eos", "end", "think_close", "call_open", "call_args", "call_close")
    )
    assert m.end_ids == (ids["end"], ids["eos"])
    assert MarkupIds(eos=0, end=None, think_close=None, call_open=None, call_args=None, call_close=None).end_ids == (0,)
    with pytest.raises(ValueError, match="thinking_budget: the tokenizer has no think_close token"):
        ChatDecoding(
            tok, vocab_size=model_vocab(), max_tokens=10, thinking_budget=5, ids=MarkupIds(0, 5, None, 8, 9, 10)
        )


def test_a_token_that_is_not_allowed_is_refused(ids):
    dec = _decoding(tools=TOOLS, tool_choice="required")
    with pytest.raises(ValueError, match="not allowed in phase content"):
        dec.accept(ids["end"])
    with pytest.raises(ValueError, match="not allowed"):
        dec.accept(model_vocab() - 1)  # a padding id


def test_markup_that_is_not_special_is_never_text(ids, tok):
    """An imported tokenizer may not mark its markup special (an added ``<think>``): still never text."""
    plain = [t for t in range(tok.vocab_size) if t not in tok.special_ids and tokenizer().decode([t]).isalpha()][:2]
    markup = MarkupIds(
        ids["eos"], ids["end"], ids["think_close"], ids["call_open"], ids["call_args"], ids["call_close"]
    )
    markup = dataclasses.replace(markup, think_open=plain[0], end=plain[1])
    for model in ("random", "longest"):
        dec = _decoding(ids=markup, thinking_budget=30, tools=TOOLS, tool_choice={"name": "search"})
        logits = preferences(model) + np.isin(np.arange(model_vocab()), plain) * 1e3  # it wants them
        out = _drive(dec, model, 0, logits=logits, ends=set(markup.end_ids))
        assert plain[0] not in out and out[-1] == plain[1] and out.count(plain[1]) == 1
        dec = _decoding(ids=markup, thinking_budget=None)
        assert not dec.allowed()[plain[0]] and dec.allowed()[plain[1]]
