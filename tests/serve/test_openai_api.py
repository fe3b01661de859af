"""The live server through the official ``openai`` SDK: plain, streamed, tool calls, budgets, formats."""

import base64
import io
import json

import anthropic
import jsonschema
import openai
import pytest
from conftest import BUDGETS, MODEL
from PIL import Image

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "detail": {
            "type": "object",
            "properties": {"hourly": {"type": "boolean"}, "fields": {"type": "array", "items": {"type": "string"}}},
            "required": ["hourly"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the docs",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _ask(text="What is 2 + 2?"):
    return [{"role": "user", "content": text}]


def test_models_lists_the_served_model(openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    context = models.data[0].model_extra["max_model_len"]
    prompt = openai_client.completions.create(model=MODEL, prompt="def f", max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match=f"context is {context} tokens"):
        openai_client.completions.create(model=MODEL, prompt="def f", max_tokens=context - prompt + 1)


def test_plain_chat_has_usage_reasoning_and_tier(openai_client):
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_ask(), max_tokens=24, temperature=0, reasoning_effort="low"
    )
    assert raw.headers["x-jaxmoe-tier"] == "low"
    r = raw.parse()
    msg = r.choices[0].message
    u = r.usage
    assert r.choices[0].finish_reason in ("stop", "length")
    assert u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 < u.completion_tokens_details.reasoning_tokens <= BUDGETS["low"]
    extra = msg.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] and isinstance(extra["reasoning_content"], str)
    for marker in ("<|", "|>"):
        assert marker not in (msg.content or "") and marker not in extra["reasoning_content"]


@pytest.mark.parametrize(
    "effort, tier, thinks",
    [("none", "low", False), ("minimal", "low", True), ("low", "low", True), ("medium", "high", True),
     ("high", "high", True), ("xhigh", "max", True), ("max", "max", True)],
)  # fmt: skip
def test_every_reasoning_effort(openai_client, effort, tier, thinks):
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_ask(), max_tokens=48, temperature=0, reasoning_effort=effort
    )
    assert raw.headers["x-jaxmoe-tier"] == tier
    r = raw.parse()
    reasoning = r.usage.completion_tokens_details.reasoning_tokens
    assert reasoning <= BUDGETS[tier]
    if thinks:
        assert reasoning > 0
    else:
        assert reasoning == 0 and r.choices[0].message.model_extra["reasoning_content"] == ""


def test_stream_matches_whole_answer(openai_client):
    args = dict(model=MODEL, messages=_ask("Name a colour."), max_tokens=30, temperature=0, reasoning_effort="low")
    whole = openai_client.chat.completions.create(**args)
    chunks = list(openai_client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks[:-1])
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == whole.choices[0].message.model_extra["reasoning_content"]
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def _check_call(call, name=None):
    assert name is None or call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    assert call.id and call.type == "function"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tool_call_validates(openai_client, choice, temperature):
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=_ask("Weather in Paris?"),
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=400,
        temperature=temperature,
        seed=3,
        reasoning_effort="high",
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        _check_call(call, None if choice == "required" else "get_weather")
    assert "<|" not in (c.message.content or "")


def test_streamed_tool_call_arrives_in_pieces(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=_ask("Weather in Oslo?"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    calls, finish, pieces = {}, None, 0
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            if d.function.arguments:
                entry["arguments"] += d.function.arguments
                pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and pieces > 1
    for entry in calls.values():
        assert entry["id"] and entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), WEATHER)


def test_json_schema_response_format(openai_client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=_ask("Answer in JSON."),
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        max_tokens=400,
        temperature=1.0,
        seed=5,
        reasoning_effort="low",
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_multi_turn_history_with_reasoning_and_tool_results(openai_client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 C.", "reasoning": "The tool said 21."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    assert raw.headers["x-jaxmoe-tier"] == "max"  # auto routing: tool results in the history
    r = raw.parse()
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.completion_tokens_details.reasoning_tokens <= BUDGETS["max"]


def test_completions_equal_jaxmoe_generate(openai_client, run):
    from jaxmoe.inference.generate import generate

    r = openai_client.completions.create(model=MODEL, prompt="def ", max_tokens=12, temperature=0)
    ref = generate(run.workdir, "def ", max_new_tokens=12)
    assert r.choices[0].text == ref["completion"]
    assert r.usage.completion_tokens == len(ref["tokens"])
    streamed = openai_client.completions.create(model=MODEL, prompt="def ", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref["completion"]


def test_an_image_to_a_text_only_model_is_a_400(openai_client, anthropic_client):
    url = "data:image/png;base64," + base64.b64encode(_PNG).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: this model takes no image input"):
        openai_client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}]
        )
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]}}
    with pytest.raises(anthropic.BadRequestError, match="this model takes no image input"):
        anthropic_client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [block]}])


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


_PNG = _png()
