"""Output parsing: streamed deltas against a whole-segment reference, UTF-8 held back, stray markup
dropped, and the render -> model output -> parse -> render round trip of a multi-turn history."""

import json

import numpy as np
import pytest

from jaxmoe.chat.format import NATIVE_SPECIAL_TOKENS
from jaxmoe.chat.parser import ARGUMENTS, CONTENT, REASONING, TOOL_CALL, Delta, OutputParser, ParsedCall, parse
from jaxmoe.chat.template import render, render_text
from jaxmoe.chat.tokenizer import Tokenizer

CORPUS = [
    "Hello world, how are you? The weather in Paris is sunny and warm today.",
    'get_weather {"city": "Paris", "unit": "celsius"} {"temperature": 21}',
    "Let me think about this step by step. First, the user wants the weather.",
    "Café, naïve, 日本語のテキスト, emoji 😀 and the euro sign €.",
]
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CORPUS * 4, vocab_size=400)


def _s(tok, name):
    return tok.token_id(f"<|{name}|>")


def _stream(tok, ids, thinking=True):
    parser = OutputParser(tok, thinking=thinking)
    deltas = [d for t in ids for d in parser.feed(t)]
    return deltas + parser.finish(), parser


def _joined(deltas):
    """(reasoning, content, [(name, arguments)]) that a delta stream adds up to."""
    text = {REASONING: "", CONTENT: ""}
    calls = []
    for d in deltas:
        if d.kind == TOOL_CALL:
            assert d.index == len(calls)
            calls.append([d.name, ""])
        elif d.kind == ARGUMENTS:
            calls[d.index][1] += d.text
        else:
            text[d.kind] += d.text
    return text[REASONING], text[CONTENT], [tuple(c) for c in calls]


def _reference(tok, ids, thinking):
    """The slow reference: segments cut by the markup, each decoded whole at the end."""
    close, call, args, call_end = (_s(tok, n) for n in ("/think", "tool_call", "tool_args", "/tool_call"))
    ends = {_s(tok, "end"), tok.eos_id}
    state, segments, count = ("reasoning" if thinking else "content"), [], 0
    segments.append([state, []])
    for t in ids:
        if state == "reasoning" and t != close and t not in ends:
            count += 1
        if t in ends:
            break
        if t not in tok.special_ids:
            segments[-1][1].append(t)
            continue
        moves = {("reasoning", close): "content", ("content", call): "name", ("name", args): "args"}
        moves |= {("name", call_end): "content", ("args", call_end): "content"}
        if (state, t) in moves:
            state = moves[state, t]
            segments.append([state, []])
    text = {"reasoning": "", "content": ""}
    calls = []
    for kind, seg in segments:
        if kind == "name":
            calls.append([tok.decode(seg).strip(), ""])
        elif kind == "args":
            calls[-1][1] += tok.decode(seg)
        else:
            text[kind] += tok.decode(seg)
    return text["reasoning"], text["content"], [tuple(c) for c in calls], count


@pytest.mark.parametrize("thinking", [True, False])
def test_streaming_matches_whole_segment_decoding(tok, thinking):
    rng = np.random.default_rng(0 if thinking else 1)
    specials = sorted(tok.special_ids)
    byte_tokens = [i for ch in "€😀日ï" for i in tok.encode(ch)]  # pieces of multi-byte characters
    for trial in range(300):
        n = int(rng.integers(0, 60))
        kinds = rng.choice(3, size=n, p=[0.6, 0.25, 0.15])
        pools = [np.arange(len(specials), tok.vocab_size), np.asarray(byte_tokens), np.asarray(specials)]
        ids = [int(rng.choice(pools[k])) for k in kinds]
        if trial % 3:  # mostly without the end tokens, so the whole sequence is parsed
            ids = [i for i in ids if i not in (_s(tok, "end"), tok.eos_id)]
        deltas, parser = _stream(tok, ids, thinking)
        reasoning, content, calls, count = _reference(tok, ids, thinking)
        assert _joined(deltas) == (reasoning, content, calls), ids
        assert parser.reasoning_tokens == count
        got = parse(ids, tok, thinking=thinking)
        assert (got.reasoning, got.content, got.reasoning_tokens) == (reasoning, content, count)
        assert got.tool_calls == [ParsedCall(name, arguments) for name, arguments in calls]
        for d in deltas:
            assert d.text or d.kind == TOOL_CALL
            assert not any(m in d.text or m in (d.name or "") for m in NATIVE_SPECIAL_TOKENS), (ids, d)


def test_valid_utf8_streams_without_replacement_characters(tok):
    rng = np.random.default_rng(2)
    alphabet = list("ab €😀日本語ïé𝄞\n{}\":,")
    for _ in range(50):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 40))))
        deltas, _ = _stream(tok, tok.encode(text), thinking=False)
        assert "".join(d.text for d in deltas) == text
        assert all("\ufffd" not in d.text for d in deltas)


def test_multibyte_character_split_across_tokens(tok):
    clef = tok.encode("𝄞")  # U+1D11E, not in the corpus: its 4 UTF-8 bytes are 4 tokens
    assert len(clef) == 4
    parser = OutputParser(tok, thinking=True)
    assert [parser.feed(t) for t in tok.encode("a")] == [[Delta(REASONING, "a")]]
    assert [parser.feed(t) for t in clef[:3]] == [[], [], []]
    assert parser.feed(clef[3]) == [Delta(REASONING, "𝄞")]
    # A sequence cut short is flushed as U+FFFD when its segment ends, not dropped or carried over.
    assert [parser.feed(t) for t in clef[:2]] == [[], []]
    assert parser.feed(_s(tok, "/think")) == [Delta(REASONING, "\ufffd")]
    assert parser.feed(clef[0]) == []
    assert parser.finish() == [Delta(CONTENT, "\ufffd")]
    assert parser.reasoning_tokens == 1 + 4 + 2


def test_stray_markup_is_dropped(tok):
    s = {n: _s(tok, n) for n in ("think", "/think", "tool_call", "tool_args", "/tool_call", "user", "system")}
    enc = tok.encode
    ids = [*enc("a"), s["think"], s["tool_call"], s["tool_args"], s["/tool_call"], *enc("b"), s["/think"]]
    ids += [*enc("c"), s["tool_args"], s["/tool_call"], s["think"], s["/think"], s["user"], *enc("d")]
    ids += [s["tool_call"], *enc("f"), s["think"], s["tool_call"], *enc("g"), s["tool_args"], *enc("{}")]
    ids += [s["tool_args"], s["think"], s["system"], *enc("[]"), s["/tool_call"], *enc("e")]
    got = parse(ids, tok)
    assert (got.reasoning, got.content) == ("ab", "cde")
    assert got.tool_calls == [ParsedCall("fg", "{}[]")]
    assert got.reasoning_tokens == len(enc("a")) + 4 + len(enc("b"))


def test_ends_and_finish(tok):
    s = {n: _s(tok, n) for n in ("end", "/think", "tool_call", "tool_args")}
    parser = OutputParser(tok, thinking=False)
    assert parser.feed(tok.encode("x")[0]) == [Delta(CONTENT, "x")]
    assert parser.feed(s["end"]) == [] and parser.done
    assert parser.feed(tok.encode("y")[0]) == [] and parser.finish() == []
    after_eos = parse([*tok.encode("hi"), tok.eos_id, *tok.encode("no")], tok)
    assert (after_eos.reasoning, after_eos.content, after_eos.reasoning_tokens) == ("hi", "", len(tok.encode("hi")))
    # An output cut off by a length limit keeps what it had: a named call without arguments...
    cut = parse([s["/think"], s["tool_call"], *tok.encode(" get_weather ")], tok)
    assert cut.tool_calls == [ParsedCall("get_weather", "")] and cut.reasoning_tokens == 0
    # ...and a call whose arguments never closed.
    cut = parse([s["/think"], s["tool_call"], *tok.encode("f"), s["tool_args"], *tok.encode('{"a": ')], tok)
    assert cut.tool_calls == [ParsedCall("f", '{"a": ')]
    # Ids past the tokenizer's vocabulary (a padded model vocabulary) are dropped.
    assert parse([tok.vocab_size + 3, *tok.encode("ok")], tok, thinking=False).content == "ok"


def test_parallel_calls_stream_in_order(tok):
    s = {n: _s(tok, n) for n in ("/think", "tool_call", "tool_args", "/tool_call", "end")}
    ids = [*tok.encode("plan"), s["/think"], *tok.encode("Checking.")]
    for city in ("Paris", "Tokyo"):
        ids += [s["tool_call"], *tok.encode("get_weather"), s["tool_args"], *tok.encode(json.dumps({"city": city}))]
        ids.append(s["/tool_call"])
    deltas, _ = _stream(tok, [*ids, s["end"]])
    kinds = [d.kind for d in deltas]
    assert kinds.index(CONTENT) > max(i for i, k in enumerate(kinds) if k == REASONING)
    starts = [(i, d.index, d.name) for i, d in enumerate(deltas) if d.kind == TOOL_CALL]
    assert [(idx, name) for _, idx, name in starts] == [(0, "get_weather"), (1, "get_weather")]
    first_args = [i for i, d in enumerate(deltas) if d.kind == ARGUMENTS and d.index == 0]
    assert starts[0][0] < min(first_args) and max(first_args) < starts[1][0]
    assert _joined(deltas)[2] == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Tokyo"}')]


def _model_turn(tok, reasoning, content, calls):
    """The ids a model would generate for a turn (each segment encoded as it renders)."""
    s = {n: _s(tok, n) for n in ("/think", "tool_call", "tool_args", "/tool_call", "end")}
    ids = [*tok.encode(reasoning), s["/think"], *tok.encode(content)]
    for name, arguments in calls:
        ids += [s["tool_call"], *tok.encode(name), s["tool_args"], *tok.encode(arguments), s["/tool_call"]]
    return [*ids, s["end"]]


def test_render_generate_parse_round_trip(tok):
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Tokyo?"}]
    turns = [
        ("I need both cities, one at a time.", "Checking.", [("get_weather", '{"city": "Paris"}')]),
        ("Paris is done; now Tokyo.", "", [("get_weather", '{"city": "Tokyo"}')]),
        ("Both results are in: answer.", "Paris 21, Tokyo 18.", []),
    ]
    results = iter(['{"temperature": 21}', '{"temperature": 18}'])
    for step, (reasoning, content, calls) in enumerate(turns):
        prompt = render(history, tok, tools=TOOLS)
        output = _model_turn(tok, reasoning, content, calls)
        got = parse(output, tok)
        assert (got.reasoning, got.content) == (reasoning, content)
        assert got.tool_calls == [ParsedCall(n, a) for n, a in calls]
        assert got.reasoning_tokens == len(tok.encode(reasoning))
        tool_calls = [
            {"id": f"call_{step}_{j}", "name": c.name, "arguments": c.arguments} for j, c in enumerate(got.tool_calls)
        ]
        history.append(
            {"role": "assistant", "content": got.content, "reasoning": got.reasoning, "tool_calls": tool_calls}
        )
        history += [{"role": "tool", "tool_call_id": c["id"], "content": next(results)} for c in tool_calls]
        # The next prompt extends this one with exactly what was generated: a prefix cache hit.
        assert render(history, tok, tools=TOOLS)[: len(prompt) + len(output)] == prompt + output
    text = render_text(history, tok, tools=TOOLS)
    pieces = [
        "<|think|>I need both cities, one at a time.<|/think|>",
        '<|tool|>call_0_0\n{"temperature": 21}<|end|>',
        "<|think|>Paris is done; now Tokyo.<|/think|>",
        '<|tool|>call_1_0\n{"temperature": 18}<|end|>',
        "<|think|>Both results are in: answer.<|/think|>",
    ]
    at = [text.index(p) for p in pieces]
    assert at == sorted(at)
    assert text.endswith("Paris 21, Tokyo 18.<|end|><|assistant|><|think|>")


def test_thinking_off_prompt_and_parse_agree(tok):
    history = [{"role": "user", "content": "Hi"}]
    prompt = render(history, tok, thinking=False)
    output = [*tok.encode("Hello!"), _s(tok, "end")]
    got = parse(output, tok, thinking=False)
    assert (got.reasoning, got.content, got.reasoning_tokens) == ("", "Hello!", 0)
    history.append({"role": "assistant", "content": got.content, "reasoning": None})
    assert render(history, tok)[: len(prompt) + len(output)] == prompt + output


def test_markup_must_be_in_the_tokenizer():
    plain = Tokenizer.train(CORPUS, vocab_size=300, special_tokens=("<|endoftext|>",))
    with pytest.raises(ValueError, match=r"markup\.think_close '<\|/think\|>' is not a token"):
        OutputParser(plain)
