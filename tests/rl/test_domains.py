"""Tests of the RL reward domains: every reward level, splits, determinism, schemas, rendering."""

import dataclasses
import json

import jsonschema
import pytest

from jaxmoe.chat.parser import Parsed
from jaxmoe.chat.template import render
from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.rl import domains
from jaxmoe.rl.domains import (
    DOMAINS,
    TIERS,
    Answer,
    answer_from,
    budget_reward,
    code_reward,
    get_domains,
    tool_args_reward,
    tool_for,
)


def _answer(content="", *, tokens=0, budget=64, finished=True, closed=True, reasoning=""):
    return Answer(reasoning, content, tokens, budget, finished, closed)


def _all_tools():
    return [t for split in domains.SPLITS for t in domains.tools(split)]


def _schema(name):
    return next(t.schema for t in _all_tools() if t.name == name)


# --------------------------------------------------------------------------------------------
# code


@pytest.mark.parametrize(
    ("prefix", "content", "want"),
    [
        ("def f(x):\n", "    return x + 1\n", 1.0),
        ("def f(x):\n    y = x\n", "    return y\n", 1.0),
        ("def f(x):\n", "    return (", 0.5),
        ("def f(x):\n", "    if x:\n", 0.5),
        ("def f(x):\n", ")))", 0.0),
        ("def f(x):\n", "return x", 0.0),  # not indented: the def has no body
        ("def f(x):\n", "", 0.0),
        ("def f(x):\n    return x\n", "  \n", 0.0),  # whitespace earns nothing, even on a complete prefix
        ("def f(x):\n", "    return '\0'\0", 0.0),  # a null byte
    ],
)
def test_code_reward_levels(prefix, content, want):
    assert code_reward({"prefix": prefix}, _answer(content)) == want


def test_code_reward_suppresses_compiler_warnings(recwarn):
    # "\d" is an invalid escape (DeprecationWarning in 3.11) and ``x is 1`` a SyntaxWarning.
    assert code_reward({"prefix": "def f(x):\n"}, _answer("    return x is 1 or '\\d'\n")) == 1.0
    assert not [w for w in recwarn if issubclass(w.category, (SyntaxWarning, DeprecationWarning))]


def test_code_prompts_are_valid_starts_of_stdlib_functions():
    for split in domains.SPLITS:
        for p in DOMAINS["code"].prompts(split, 30, 0):
            prefix = p.data["prefix"]
            assert prefix.startswith("def ") and prefix.endswith("\n")
            assert p.messages == ({"role": "user", "content": domains.CODE_PROMPT + prefix},)
            assert domains._compiles(prefix) > 0.0


# --------------------------------------------------------------------------------------------
# tool_args


@pytest.mark.parametrize(
    ("content", "want"),
    [
        ('{"text": "a\\nb", "prefix": "> "}', 1.0),
        ('  {"text": "a", "prefix": "> ", "predicate": null}\n', 1.0),
        ('{"text": "a", "prefix": "> "} done.', 1.0),  # the first balanced {...} span is parsed
        ('{"text": "a"}', 0.75),  # a required key missing
        ('{"text": 3, "prefix": "> "}', 0.75),  # wrong type
        ('{"text": "a", "prefix": "> ", "width": 3}', 0.5),  # a key the schema lacks
        ('{"text": "a", "prefix": ', 0.25),
        ("{text: a}", 0.25),
        ('["text", "prefix"]', 0.0),
        ('Sure: {"text": "a", "prefix": "> "}', 0.0),
        ("", 0.0),
    ],
)
def test_tool_args_reward_levels(content, want):
    data = {"name": "textwrap.indent", "schema": _schema("textwrap.indent")}
    assert tool_args_reward(data, _answer(content)) == want


def test_tool_args_balanced_span_ignores_braces_in_strings():
    data = {"name": "textwrap.indent", "schema": _schema("textwrap.indent")}
    assert tool_args_reward(data, _answer('{"text": "}{", "prefix": "\\"{"} trailing')) == 1.0


def test_tool_schemas_are_valid_and_checked():
    tools = _all_tools()
    assert len(tools) >= 30
    for t in tools:
        jsonschema.Draft202012Validator.check_schema(t.schema)
        assert t.schema["additionalProperties"] is False and t.description
    cases = {
        "math.isclose": ({"a": 1.0, "b": 1, "rel_tol": 1e-3}, {"a": "1.0", "b": 1}),
        "calendar.monthrange": ({"year": 2024, "month": 2}, {"year": 2024, "month": 2.5}),
        "shlex.split": ({"s": "a 'b c'", "posix": True}, {"s": "a", "posix": 1}),
        "bisect.bisect_left": ({"a": [1, 2, 3], "x": 2, "hi": None}, {"a": [1], "x": 2, "hi": "3"}),
    }
    for name, (good, bad) in cases.items():
        validator = jsonschema.Draft202012Validator(_schema(name))
        assert validator.is_valid(good), name
        assert not validator.is_valid(bad), name


def test_tool_for_skips_variadic_callables():
    assert tool_for("textwrap.shorten") is None  # (text, width, **kwargs)
    assert tool_for("posixpath.join") is None  # (a, *p)
    schema = tool_for("textwrap.indent").schema
    assert schema["required"] == ["text", "prefix"] and schema["properties"]["predicate"] == {}


def test_tool_prompts_describe_the_tool():
    for p in DOMAINS["tool_args"].prompts("train", 5, 3):
        system, user = p.messages
        assert system["role"] == "system" and user["role"] == "user"
        assert p.data["name"] in system["content"] and p.data["name"] in user["content"]
        assert json.dumps(p.data["schema"], sort_keys=True) in system["content"]


def test_tool_splits_hold_enough_callables():
    assert len(domains.tools("heldout")) >= 6 and len(domains.tools("train")) >= 20


# --------------------------------------------------------------------------------------------
# budget


def test_budget_questions():
    questions = domains.BUDGET_QUESTIONS
    assert len(questions) == len(set(questions)) >= 40
    assert all(q.endswith("?") and "?" not in q[:-1] for q in questions)
    assert len(DOMAINS["budget"]._pool("heldout")) >= 6


def test_budget_reward_levels():
    assert budget_reward({}, _answer("zip objects", tokens=64, budget=64, closed=False)) == 0.0  # forced close
    assert budget_reward({}, _answer("   ", tokens=3, budget=64)) == 0.0
    assert budget_reward({}, _answer("an iterator", tokens=0, budget=64)) == 1.0
    assert budget_reward({}, _answer("an iterator", tokens=16, budget=64)) == pytest.approx(0.875)
    assert budget_reward({}, _answer("an iterator", tokens=32, budget=64)) == pytest.approx(0.75)
    assert budget_reward({}, _answer("an iterator", tokens=63, budget=64)) > 0.5
    assert budget_reward({}, _answer("an iterator", tokens=32, budget=64, finished=False)) == pytest.approx(0.375)
    assert budget_reward({}, _answer("an iterator", budget=0)) == 1.0
    assert budget_reward({}, _answer("an iterator", budget=0, finished=False)) == 0.5
    assert budget_reward({}, _answer("an iterator", tokens=300, budget=64)) == 0.0  # clipped at 0


def test_answer_from_closed_only_before_the_budget():
    def parsed(tokens, content="ok"):
        return Parsed("r" * tokens, content, [], tokens)

    assert answer_from(parsed(10), thinking_budget=64, finished=True).thinking_closed
    assert not answer_from(parsed(64), thinking_budget=64, finished=True).thinking_closed  # forced
    assert not answer_from(parsed(10, ""), thinking_budget=64, finished=True).thinking_closed  # no answer
    assert answer_from(parsed(0), thinking_budget=0, finished=False).thinking_closed
    a = answer_from(parsed(5), thinking_budget=8, finished=False)
    assert (a.reasoning, a.content, a.reasoning_tokens, a.thinking_budget, a.finished) == ("rrrrr", "ok", 5, 8, False)
    with pytest.raises(ValueError, match="thinking_budget"):
        answer_from(parsed(1), thinking_budget=-1, finished=True)


# --------------------------------------------------------------------------------------------
# All domains


def test_verifiers_never_execute_model_output(tmp_path):
    sentinel = tmp_path / "executed"
    attack = f"__import__('os').system('touch {sentinel}')"
    answers = [
        _answer(f"    {attack}\n    return x\n"),
        _answer(f'{{"s": "x", "posix": {attack}}}'),
        _answer(f'{{"s": "{attack}"}}'),
        _answer(attack, tokens=1),
    ]
    for answer in answers:
        assert code_reward({"prefix": "def f(x):\n"}, answer) in (0.0, 0.5, 1.0)
        assert tool_args_reward({"name": "shlex.split", "schema": _schema("shlex.split")}, answer) <= 1.0
        assert budget_reward({}, answer) <= 1.0
    assert code_reward({"prefix": "def f(x):\n"}, answers[0]) == 1.0
    assert not sentinel.exists()


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_prompts_deterministic_and_tiered(name):
    domain = DOMAINS[name]
    first = domain.prompts("train", 40, 7)
    assert first == domain.prompts("train", 40, 7)
    assert first != domain.prompts("train", 40, 8)
    assert {p.tier for p in first} == set(TIERS)
    assert {p.domain for p in first} == {name}
    assert domain.prompts("heldout", 3, 0) == domain.prompts("heldout", 3, 0)
    assert {p.tier for p in domain.prompts("heldout", 3, 0)} == set(TIERS)
    for p in first:
        json.dumps(p.data)  # JSON-serialisable
        assert 0.0 <= domain.reward(p.data, _answer("x")) <= 1.0


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_train_and_heldout_disjoint(name):
    domain = DOMAINS[name]

    def keys(split):
        return {json.dumps([p.data, p.messages], sort_keys=True) for p in domain.prompts(split, 600, 0)}

    train, heldout = keys("train"), keys("heldout")
    assert train and heldout and not train & heldout


def test_prompts_errors():
    with pytest.raises(ValueError, match="split.*'test'.*train, heldout"):
        DOMAINS["code"].prompts("test", 1, 0)
    with pytest.raises(ValueError, match="n must be"):
        DOMAINS["budget"].prompts("train", 0, 0)


def test_get_domains():
    assert get_domains(["budget", "code"]) == [DOMAINS["budget"], DOMAINS["code"]]
    with pytest.raises(ValueError, match="'math'.*allowed: budget, code, tool_args"):
        get_domains(["code", "math"])


def test_answer_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _answer().content = "x"


@pytest.fixture(scope="module")
def tokenizer():
    texts = list(domains.BUDGET_QUESTIONS) + ["def f(x):\n    return x\n"] * 4
    return Tokenizer.train(texts, vocab_size=400)


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_prompts_render(tokenizer, name):
    for p in DOMAINS[name].prompts("train", 6, 0) + DOMAINS[name].prompts("heldout", 3, 0):
        for m in p.messages:
            assert set(m) == {"role", "content"} and m["role"] in ("system", "user") and isinstance(m["content"], str)
        ids = render(list(p.messages), tokenizer, thinking=True)
        assert ids and ids[-1] == tokenizer.token_id("<|think|>")
