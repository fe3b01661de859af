"""The live server through the official ``anthropic`` SDK: messages, streams, thinking budgets, tool use."""

import jsonschema
import pytest
from conftest import BUDGETS, MODEL

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]


def _ask(text="Hello?"):
    return [{"role": "user", "content": text}]


def _thinking_tokens(message) -> int:
    return message.usage.output_tokens_details.thinking_tokens


@pytest.mark.parametrize("budget, tier", [(1, "low"), (8, "low"), (9, "high"), (16, "high"), (30, "max"), (500, "max")])
def test_thinking_budget_picks_tier_and_bounds_thinking(anthropic_client, budget, tier):
    raw = anthropic_client.messages.with_raw_response.create(
        model=MODEL, max_tokens=64, messages=_ask(), thinking={"type": "enabled", "budget_tokens": budget}
    )
    assert raw.headers["x-jaxmoe-tier"] == tier
    m = raw.parse()
    assert m.content[0].type == "thinking" and sum(b.type == "thinking" for b in m.content) == 1
    assert 0 < _thinking_tokens(m) <= min(budget, BUDGETS[tier])
    assert m.usage.output_tokens <= 64 and m.stop_reason in ("end_turn", "max_tokens")


def test_thinking_disabled_gives_no_thinking_block(anthropic_client):
    m = anthropic_client.messages.create(model=MODEL, max_tokens=20, messages=_ask(), thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in m.content) and _thinking_tokens(m) == 0


def test_count_tokens_equals_input_tokens(anthropic_client):
    body = dict(model=MODEL, system="Be brief.", messages=_ask("Count me."), tools=TOOLS)
    counted = anthropic_client.messages.count_tokens(**body)
    m = anthropic_client.messages.create(**body, max_tokens=4)
    assert counted.input_tokens == m.usage.input_tokens > 0


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_validates(anthropic_client, choice):
    m = anthropic_client.messages.create(
        model=MODEL, max_tokens=400, messages=_ask("Weather in Lima?"), tools=TOOLS, tool_choice=choice,
        thinking={"type": "enabled", "budget_tokens": 16},
    )  # fmt: skip
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and u.id for u in uses)
    for u in uses:
        jsonschema.validate(u.input, WEATHER)


def test_stream_events_and_final_message(anthropic_client):
    with anthropic_client.messages.stream(
        model=MODEL, max_tokens=400, messages=_ask("Weather in Kyiv?"), tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "enabled", "budget_tokens": 8},
    ) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds or "content_block_delta" in kinds
    assert final.content[0].type == "thinking" and final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER)


def test_multi_turn_with_thinking_and_tool_results(anthropic_client):
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome", "metric": True}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]},
    ]
    m = anthropic_client.messages.create(model=MODEL, max_tokens=30, messages=messages, tools=TOOLS)
    assert m.content[0].type == "thinking" and _thinking_tokens(m) <= BUDGETS["max"]
