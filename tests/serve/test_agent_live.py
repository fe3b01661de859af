"""AgentSession and ``jaxmoe agent`` against the live server: several forced tool turns, a complete transcript."""

import json
import os
import subprocess
import sys

import httpx2 as httpx
import jsonschema
import openai
import pytest
from conftest import MODEL

from jaxmoe.agent import AgentError, AgentSession
from jaxmoe.agent.sandbox import file_tools

TOOL_TURNS = 3


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def a():\n    return 1\n")
    (tmp_path / "notes.txt").write_text("the notes\n")
    return tmp_path


def _recording_client(server, sent: list):
    def record(request):
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    http = httpx.Client(event_hooks={"request": [record]}, timeout=120)
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.key, http_client=http)


def test_agent_calls_tools_for_several_turns_with_the_whole_history(server, tree, tmp_path):
    sent = []
    session = AgentSession(
        _recording_client(server, sent),
        file_tools(tree),
        model=MODEL,
        thinking="low",
        timeout=120,
        max_turns=TOOL_TURNS + 1,
        tool_choice=lambda turn: "required" if turn < TOOL_TURNS else "none",
        max_tokens=48,
        request_options={"temperature": 0.0, "stop": ["\n"]},
    )
    try:
        answer = session.run("Look around the project and say what it holds.")
    except AgentError as e:  # the random model's last answer may not reach "\n" in 48 tokens: it is kept
        assert f"turn {TOOL_TURNS + 1}: the answer was cut at its token limit" in str(e)
        answer = session.messages[-1]["content"]
    assert len(sent) == TOOL_TURNS + 1 and session.context_tokens > 0  # max_model_len from GET /v1/models
    assert sent[0]["tool_choice"] == "required" and sent[-1]["tool_choice"] == "none"
    assert all(body["reasoning_effort"] == "low" for body in sent)
    # Every request carried the whole history so far, and the transcript is that history plus the answer.
    for n, body in enumerate(sent):
        assert body["messages"] == session.messages[: len(body["messages"])]
        assert n == 0 or len(body["messages"]) > len(sent[n - 1]["messages"])
    assert session.messages[-1] == {k: v for k, v in session.messages[-1].items()}
    assert session.messages[-1]["content"] == answer and "tool_calls" not in session.messages[-1]
    assert sent[-1]["messages"] == session.messages[:-1]
    # Order: user, then per tool turn an assistant message with calls followed by one result per call, in order.
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in sent[0]["tools"]}
    assert session.messages[0] == {"role": "user", "content": "Look around the project and say what it holds."}
    i, tool_turns = 1, 0
    while session.messages[i].get("tool_calls"):
        calls = session.messages[i]["tool_calls"]
        assert "reasoning_content" in session.messages[i]  # reasoning kept, sent back unchanged
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        results = session.messages[i + 1 : i + 1 + len(calls)]
        assert [r["tool_call_id"] for r in results] == [c["id"] for c in calls]
        assert all(r["role"] == "tool" and r["content"] for r in results)
        i, tool_turns = i + 1 + len(calls), tool_turns + 1
    assert tool_turns == TOOL_TURNS and i == len(session.messages) - 1
    assert [t["turn"] for t in session.turns] == [1, 2, 3, 4]
    assert all(t["usage"]["total_tokens"] > 0 and t["latency_s"] > 0 for t in session.turns)
    path = tmp_path / "live.jsonl"
    session.save(path)
    resumed = AgentSession.resume(path, session.client, file_tools(tree))
    assert resumed.messages == session.messages


def test_jaxmoe_agent_cli_against_the_server(server, tree, tmp_path):
    env = {**os.environ, "AGENT_KEY": server.key}
    transcript = tmp_path / "cli.jsonl"
    args = [sys.executable, "-m", "jaxmoe", "agent", "--base-url", f"{server.base_url}/v1"]
    args += ["--api-key-env", "AGENT_KEY", "--task", "list the files", "--tools", "files", "--root", str(tree)]
    args += ["--thinking", "low", "--max-turns", "1", "--transcript", str(transcript)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in transcript.read_text().splitlines()]
    assert lines[0]["model"] == MODEL and lines[0]["tools"] == ["list_files", "read_file", "search_files"]
    assert lines[1]["message"] == {"role": "user", "content": "list the files"}
    # One turn: either a final answer (exit 0) or tool calls and then max_turns (exit 1, said on stderr).
    assert done.returncode in (0, 1), done.stderr
    if done.returncode == 1:
        assert "max_turns=1" in done.stderr or "finish_reason=length" in done.stderr
    bad = subprocess.run(
        args[:4] + ["--base-url", "http://x", "--task", "t", "--tools", "web"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--tools: unknown tool set 'web'" in bad.stderr
    wrong_key = subprocess.run(
        args[:-2], env={**os.environ, "AGENT_KEY": "sk-wrong"}, capture_output=True, text=True, timeout=120
    )
    assert wrong_key.returncode == 1 and "/models: HTTP 401: invalid or missing API key" in wrong_key.stderr
    with_model = subprocess.run(
        [*args[:-2], "--model", MODEL], env={**os.environ, "AGENT_KEY": "sk-wrong"}, capture_output=True, text=True
    )
    assert with_model.returncode == 1 and "HTTP 401 (not retried): invalid or missing API key" in with_model.stderr
