"""AgentSession against a scripted, fault-injecting OpenAI-compatible server (429, 5xx, hangs, drops)."""

import http.server
import json
import socket
import threading
import time

import openai
import pytest

from jaxmoe.agent import AgentError, AgentSession, Tool


class FakeEndpoint(http.server.ThreadingHTTPServer):
    """Answers each POST /v1/chat/completions with the next scripted action, recording every body."""

    daemon_threads = True

    def __init__(self, max_model_len=None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.script, self.bodies, self.max_model_len = [], [], max_model_len
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, status, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        data = [{"id": "m", "object": "model", "created": 0, "owned_by": "test"}]
        if self.server.max_model_len is not None:
            data[0]["max_model_len"] = self.server.max_model_len
        self._json(200, {"object": "list", "data": data})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append(body)
        action, *arg = self.server.script.pop(0)
        if action == "drop":
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if action == "hang":
            time.sleep(arg[0])
            action, arg = "ok", [answer("late")]
        try:
            if action == "ok":
                self._json(200, arg[0])
            else:
                headers = [("retry-after", arg[0])] if arg else []
                self._json(int(action), {"error": {"message": f"scripted {action}", "type": "x"}}, headers)
        except (BrokenPipeError, ConnectionResetError):
            pass


def answer(content, *, calls=(), reasoning_key="reasoning_content", finish=None, total=10):
    message = {"role": "assistant", "content": content, reasoning_key: f"thought about {content!r}"}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ]
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish or ("tool_calls" if calls else "stop")}],
        "usage": {"prompt_tokens": total - 2, "completion_tokens": 2, "total_tokens": total},
    }


def echo(text: str, wait: float = 0.0) -> str:
    """Echo a text after a wait.

    Args:
        text: what to echo.
        wait: seconds to wait first.
    """
    time.sleep(wait)
    return f"echo:{text}"


@pytest.fixture
def endpoint():
    server = FakeEndpoint()
    yield server
    server.shutdown()
    server.server_close()


def session_for(endpoint, client_retries=0, **options):
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="sk-x", max_retries=client_retries)
    options.setdefault("backoff_base", 0.01)
    options.setdefault("context_tokens", 10**6)
    return AgentSession(client, [echo], model="m", **options)


def test_faults_are_retried_and_no_turn_is_recorded_twice(endpoint):
    calls = [("echo", '{"text": "a", "wait": 0.3}'), ("echo", '{"text": "b"}')]
    endpoint.script = [("429", "1"), ("500",), ("hang", 3), ("drop",), ("ok", answer(None, calls=calls))]
    endpoint.script += [("503",), ("ok", answer("done"))]
    session = session_for(endpoint, timeout=0.8, max_retries=4)
    start = time.monotonic()
    assert session.run("do it") == "done"
    assert time.monotonic() - start >= 1.0  # Retry-After: 1 was honoured
    assert len(endpoint.bodies) == 7
    assert [t["attempts"] for t in session.turns] == [5, 2]
    assert session.turns[0]["failures"] == [429, 500, "timeout", "connection error"]
    assert session.turns[1]["failures"] == [503]
    for body in endpoint.bodies[:5]:  # every attempt of a turn sends the same history
        assert body["messages"] == [{"role": "user", "content": "do it"}]
    first = endpoint.bodies[0]
    assert first["tool_choice"] == "auto" and first["tools"][0]["function"]["name"] == "echo"
    assert "reasoning_effort" not in first  # thinking="auto" sends none
    roles = [m["role"] for m in session.messages]
    assert roles == ["user", "assistant", "tool", "tool", "assistant"]
    assert session.messages[1]["reasoning_content"] == "thought about None"
    assert [m["content"] for m in session.messages[2:4]] == ["echo:a", "echo:b"]  # call order, not finish order
    assert [m["tool_call_id"] for m in session.messages[2:4]] == ["call_0", "call_1"]
    assert endpoint.bodies[5]["messages"] == endpoint.bodies[6]["messages"] == session.messages[:4]
    assert session.turns[0]["tools"][0]["name"] == "echo" and session.turns[0]["usage"]["total_tokens"] == 10


def test_fails_after_max_retries_whatever_the_clients_own_setting(endpoint):
    endpoint.script = [("500",), ("502",), ("429", "0"), ("ok", answer("too late"))]
    session = session_for(endpoint, client_retries=5, max_retries=2)
    with pytest.raises(AgentError, match=r"3 attempts failed \(max_retries=2\); the last: 429") as info:
        session.run("task")
    assert info.value.attempts == 3 and info.value.status == 429
    assert len(endpoint.bodies) == 3
    assert session.messages == [{"role": "user", "content": "task"}]


@pytest.mark.parametrize("status", ["400", "401", "404", "422"])
def test_client_errors_are_not_retried(endpoint, status):
    endpoint.script = [(status,), ("ok", answer("never"))]
    with pytest.raises(AgentError, match=f"HTTP {status} \\(not retried\\): scripted {status}") as info:
        session_for(endpoint, max_retries=3).run("task")
    assert info.value.status == int(status) and info.value.attempts == 1
    assert len(endpoint.bodies) == 1


def test_reasoning_key_and_thinking_tier_go_back_unchanged(endpoint):
    endpoint.script = [("ok", answer("", calls=[("echo", '{"text": "x"}')], reasoning_key="reasoning"))]
    endpoint.script += [("ok", answer("fin", reasoning_key="reasoning"))]
    session = session_for(endpoint, thinking="max")
    assert session.run("t") == "fin"
    sent = endpoint.bodies[1]["messages"][1]
    assert sent["reasoning"] == "thought about ''" and "reasoning_content" not in sent
    assert [b["reasoning_effort"] for b in endpoint.bodies] == ["max", "max"]
    assert session.messages[-1] == {"role": "assistant", "content": "fin", "reasoning": "thought about 'fin'"}


def test_bad_tool_arguments_and_tool_timeouts_are_told_to_the_model(endpoint):
    calls = [("echo", '{"text": 5}'), ("echo", "{oops"), ("echo", '{"text": "slow", "wait": 30}'), ("nope", "{}")]
    endpoint.script = [("ok", answer(None, calls=calls)), ("ok", answer("ok"))]
    session = session_for(endpoint, timeout=0.5)
    start = time.monotonic()
    session.run("t")
    assert time.monotonic() - start < 10  # the overrunning tool was abandoned
    results = [m["content"] for m in session.messages if m["role"] == "tool"]
    assert "at text: 5 is not of type 'string'" in results[0]
    assert "not valid JSON" in results[1]
    assert "echo timed out after 0.5 s" in results[2]
    assert "no tool named 'nope'" in results[3]
    assert [t["status"] for t in session.turns[0]["tools"]] == ["error", "error", "timeout", "error"]


def test_max_turns_then_save_and_resume(endpoint, tmp_path):
    endpoint.script = [("ok", answer(None, calls=[("echo", f'{{"text": "{i}"}}')])) for i in range(3)]
    session = session_for(endpoint, max_turns=3)
    with pytest.raises(AgentError, match="max_turns=3"):
        session.run("loop")
    assert [m["role"] for m in session.messages] == ["user"] + ["assistant", "tool"] * 3
    path = tmp_path / "session.jsonl"
    session.save(path)
    assert [json.loads(line)["type"] for line in path.read_text().splitlines()][:2] == ["session", "message"]
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="sk-x")
    resumed = AgentSession.resume(path, client, [echo], backoff_base=0.01)
    assert resumed.messages == session.messages and resumed.turns == session.turns and resumed.model == "m"
    endpoint.script = [("ok", answer("resumed"))]
    assert resumed.run() == "resumed"
    assert endpoint.bodies[-1]["messages"] == session.messages


def test_a_run_cut_off_mid_turn_runs_the_missing_tool_calls_on_resume(endpoint, tmp_path):
    endpoint.script = [("ok", answer(None, calls=[("echo", '{"text": "a"}'), ("echo", '{"text": "b"}')]))]
    session = session_for(endpoint)
    session.messages.append({"role": "user", "content": "t"})
    message, record = session._request(0)
    session.messages += [message, {"role": "tool", "tool_call_id": "call_0", "content": "echo:a"}]
    session.turns.append(record)
    session.save(tmp_path / "cut.jsonl")
    resumed = AgentSession.resume(
        tmp_path / "cut.jsonl", openai.OpenAI(base_url=endpoint.base_url, api_key="k"), [echo]
    )
    endpoint.script = [("ok", answer("end"))]
    assert resumed.run() == "end"
    assert [m.get("tool_call_id") for m in resumed.messages if m["role"] == "tool"] == ["call_0", "call_1"]


def test_a_nearly_full_context_stops_the_session_with_the_counts():
    endpoint = FakeEndpoint(max_model_len=1000)
    try:
        endpoint.script = [("ok", answer(None, calls=[("echo", '{"text": "a"}')], total=950))]
        session = session_for(endpoint, context_tokens=None)
        with pytest.raises(AgentError, match="history is 950 tokens .* context is 1000 tokens.*context_reserve=100"):
            session.run("t")
        assert len(endpoint.bodies) == 1 and session.context_tokens == 1000
        assert [m["role"] for m in session.messages] == ["user", "assistant", "tool"]
    finally:
        endpoint.shutdown()
        endpoint.server_close()


def test_a_cut_answer_and_bad_options_are_errors(endpoint):
    endpoint.script = [("ok", answer("half an ans", finish="length"))]
    with pytest.raises(AgentError, match="finish_reason=length"):
        session_for(endpoint).run("t")
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="k")
    with pytest.raises(ValueError, match="thinking: must be one of auto, low, high, max"):
        AgentSession(client, model="m", thinking="medium")
    with pytest.raises(ValueError, match="max_retries: must be an integer >= 0"):
        AgentSession(client, model="m", max_retries=-1)
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        AgentSession(client, [echo, Tool("echo", "", {"type": "object"}, echo)], model="m")
    with pytest.raises(ValueError, match="nothing to continue"):
        AgentSession(client, model="m").run()
