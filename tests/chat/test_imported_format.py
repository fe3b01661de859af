"""An imported family's chat format (DeepSeek V3.1's tokens, a jinja template): its markup is found
in its tokenizer, its output parses into reasoning, content and tool calls, and forced calls work."""

import json

import jsonschema
import numpy as np
import pytest

from jaxmoe.chat.decoding import ChatDecoding, MarkupIds
from jaxmoe.chat.format import NATIVE, markup_for
from jaxmoe.chat.parser import parse
from jaxmoe.chat.template import render
from jaxmoe.chat.tokenizer import Tokenizer

BEGIN, SEP, END_CALL = (
    "<\uff5ctool\u2581call\u2581begin\uff5c>",
    "<\uff5ctool\u2581sep\uff5c>",
    "<\uff5ctool\u2581call\u2581end\uff5c>",
)
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
SPECIALS = (EOS, "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "<think>", "</think>", BEGIN, SEP, END_CALL)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<\uff5cUser\uff5c>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<\uff5cAssistant\uff5c>{{ m['content'] }}" + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<\uff5cAssistant\uff5c>{% if enable_thinking %}<think>{% else %}</think>{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["def f(x):\n    return x + 1\n" * 50, "The weather in Paris is mild. " * 50]
    trained = Tokenizer.train(texts, 400, special_tokens=("<|endoftext|>", *SPECIALS))
    return Tokenizer(trained.hf, eos_token=EOS, bos_token=EOS, chat_template=TEMPLATE)


def test_markup_is_found_in_the_tokenizer(tokenizer):
    markup = markup_for(tokenizer)
    assert markup != NATIVE and (markup.think_open, markup.think_close) == ("<think>", "</think>")
    assert (markup.call_open, markup.call_args, markup.call_close, markup.end) == (BEGIN, SEP, END_CALL, EOS)


def test_prompt_opens_thinking_and_output_parses(tokenizer):
    prompt = render([{"role": "user", "content": "Weather?"}], tokenizer, thinking=True)
    assert prompt[-1] == tokenizer.token_id("<think>")
    t = tokenizer.token_id
    out = [*tokenizer.encode("look it up"), t("</think>"), *tokenizer.encode("Sure."), t(BEGIN)]
    out += [*tokenizer.encode("get_weather"), t(SEP), *tokenizer.encode('{"city": "Paris"}'), t(END_CALL), t(EOS)]
    parsed = parse(out, tokenizer, markup=markup_for(tokenizer))
    assert (parsed.reasoning, parsed.content) == ("look it up", "Sure.")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_forced_call_in_the_imported_format_validates(tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"name": "get_weather", "description": "", "parameters": schema}]
    markup = markup_for(tokenizer)
    decoding = ChatDecoding(
        tokenizer, vocab_size=tokenizer.vocab_size, max_tokens=400, thinking_budget=20, tools=tools,
        tool_choice="required", ids=MarkupIds.from_tokenizer(tokenizer, markup),
    )  # fmt: skip
    rng, out = np.random.default_rng(0), []
    while len(out) < 400:
        allowed = decoding.allowed()
        token = int(rng.choice(np.flatnonzero(allowed)))
        decoding.accept(token)
        out.append(token)
        if token == tokenizer.eos_id:
            break
    parsed = parse(out, tokenizer, markup=markup)
    assert parsed.tool_calls and parsed.reasoning_tokens <= 20
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schema)
