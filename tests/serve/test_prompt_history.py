"""The prompt the engine sees for a multi-turn history holds every earlier reasoning block and tool
result, in order, from both APIs' request bodies (rendered in-process, compared as text)."""

import pytest

from jaxmoe.serve import ServeConfig, anthropic_api, build_service, openai_api
from jaxmoe.serve.errors import APIError

MODEL = "history"
REASONING = ["first I look it up", "the tool said 21, then I check tomorrow", "now the answer"]
RESULTS = ['{"temp": 21}', '{"temp": 19, "rain": true}']


@pytest.fixture(scope="module")
def service(run):
    return build_service(run.workdir, ServeConfig(model_name=MODEL, cache_bytes=1 << 22, page_size=8, warmup_context=0))


def _openai_history():
    call = lambda i, city: {"id": f"call_{i}", "type": "function",
                            "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}  # fmt: skip
    return [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Rome today and tomorrow?"},
        {"role": "assistant", "content": None, "reasoning_content": REASONING[0], "tool_calls": [call(1, "Rome")]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULTS[0]},
        {"role": "assistant", "content": "", "reasoning": REASONING[1], "tool_calls": [call(2, "Rome")]},
        {"role": "tool", "tool_call_id": "call_2", "content": RESULTS[1]},
        {"role": "assistant", "content": "21 today, 19 and rain tomorrow.", "reasoning_content": REASONING[2]},
        {"role": "user", "content": "Thanks. Umbrella?"},
    ]


def _anthropic_history():
    use = lambda i: {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": "Rome"}}
    result = lambda i: {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": RESULTS[i - 1]}
    think = lambda i: {"type": "thinking", "thinking": REASONING[i], "signature": "s"}
    return [
        {"role": "user", "content": "Weather in Rome today and tomorrow?"},
        {"role": "assistant", "content": [think(0), use(1)]},
        {"role": "user", "content": [result(1)]},
        {"role": "assistant", "content": [think(1), use(2)]},
        {"role": "user", "content": [result(2)]},
        {"role": "assistant", "content": [think(2), {"type": "text", "text": "21 today, 19 and rain tomorrow."}]},
        {"role": "user", "content": "Thanks. Umbrella?"},
    ]


TOOLS_OPENAI = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOLS_ANTHROPIC = [{"name": "get_weather", "input_schema": {"type": "object"}}]


def _assert_in_order(text: str, pieces: list[str]) -> None:
    at = 0
    for piece in pieces:
        found = text.find(piece, at)
        assert found >= 0, f"{piece!r} missing (or out of order) in the prompt:\n{text}"
        at = found + len(piece)


def test_openai_history_is_rendered_in_full(service):
    body = {"model": MODEL, "messages": _openai_history(), "tools": TOOLS_OPENAI, "max_tokens": 8}
    job = openai_api._chat_job(service, body, "tenant")
    text = service.tokenizer.decode(job.prompt_ids)
    _assert_in_order(text, [REASONING[0], RESULTS[0], REASONING[1], RESULTS[1], REASONING[2], "Umbrella?"])
    assert text.endswith("<|assistant|><|think|>")


def test_anthropic_history_is_rendered_in_full(service):
    body = {"model": MODEL, "messages": _anthropic_history(), "tools": TOOLS_ANTHROPIC, "max_tokens": 8}
    job = anthropic_api._job(service, body, "tenant")
    text = service.tokenizer.decode(job.prompt_ids)
    _assert_in_order(text, [REASONING[0], RESULTS[0], REASONING[1], RESULTS[1], REASONING[2], "Umbrella?"])


def test_both_apis_render_the_same_conversation_alike(service):
    """The same turns through either API give the same prompt (tool-call ids aside)."""
    a = openai_api._chat_job(service, {"model": MODEL, "messages": _openai_history()[1:], "max_tokens": 8}, "t")
    b = anthropic_api._job(service, {"model": MODEL, "messages": _anthropic_history(), "max_tokens": 8}, "t")
    norm = lambda job: service.tokenizer.decode(job.prompt_ids).replace("toolu_", "call_")
    assert norm(a) == norm(b)


def test_thinking_off_closes_the_thinking_block_in_the_prompt(service):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}
    job = openai_api._chat_job(service, body, "t")
    assert service.tokenizer.decode(job.prompt_ids).endswith("<|assistant|><|think|><|/think|>")
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"}}  # fmt: skip
    assert anthropic_api._job(service, body, "t").prompt_ids == job.prompt_ids


def test_unsupported_content_is_refused_by_name(service):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(APIError, match=r"messages\[0\]\.content\[0\]"):
        openai_api._chat_job(service, body, "t")
