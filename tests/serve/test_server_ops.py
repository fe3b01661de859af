"""Auth, overload, bad input, disconnects, metrics and TLS of the live server (plain HTTP and the SDKs)."""

import argparse
import asyncio
import time

import httpx2 as httpx
import pytest
from conftest import KEYS, MAX_QUEUE, MODEL, SLOTS, start_server, stop_server

from jaxmoe.serve.cli import add_arguments, config_from_args

ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "def "}),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/metrics", None),
]


def _anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[r[1] for r in ROUTES])
@pytest.mark.parametrize("style", ["bearer", "x-api-key"])
def test_every_protected_route_needs_a_key(server, method, path, body, style):
    wrong = {"Authorization": "Bearer nope"} if style == "bearer" else {"x-api-key": "nope"}
    for headers in ({}, wrong):
        r = httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        err = r.json()
        if _anthropic(path):
            assert err["type"] == "error" and err["error"]["type"] == "authentication_error"
        else:
            assert err["error"]["type"] == "authentication_error" and err["error"]["message"]
    good = {"Authorization": f"Bearer {KEYS[1]}"} if style == "bearer" else {"x-api-key": KEYS[1]}
    r = httpx.request(method, server.base_url + path, json=body, headers=good, timeout=120)
    assert r.status_code == 200, r.text


def test_health_needs_no_key(server):
    r = httpx.get(server.base_url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert isinstance(r.json()["compiling"], int) and r.json()["compiling"] >= 0  # step programs queued


@pytest.mark.parametrize("value, ok", [("-1", False), ("0", True), ("4096", True)])
def test_warmup_context_flag(value, ok):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--checkpoint", "x", "--warmup-context", value])
    args.parser = parser
    if ok:
        assert config_from_args(args).warmup_context == int(value)
    else:
        with pytest.raises(SystemExit):
            config_from_args(args)


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
         "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": -1}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 7},
         400, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "reasoning_effort": "huge"}, 400, "reasoning_effort"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                  "min_tokens": 5}, 400, "min_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400,
         "max_tokens"),
        ("/v1/messages", {"model": "other", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404,
         "model"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": []}, 400, "messages"),
    ],
)  # fmt: skip
def test_bad_input_names_the_field(server, path, body, status, field):
    r = httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    if _anthropic(path):
        kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert err["error"]["type"] == kind and field.split(".")[0] in err["error"]["message"]
    else:
        assert field in err["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_malformed_json_and_long_prompt_are_400(server, path):
    r = httpx.post(server.base_url + path, content=b"{not json", headers=server.headers(), timeout=30)
    assert r.status_code == 400
    long = "word " * 5000
    body = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": long}]}
    r = httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=60)
    assert r.status_code == 400 and "4096" in r.text


def _chat(effort: str, max_tokens: int, text: str = "go"):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "reasoning_effort": effort,
    }


async def _post(client, server, body):
    r = await client.post(server.base_url + "/v1/chat/completions", json=body, headers=server.headers())
    return r


def test_full_queue_is_429_with_retry_after_and_admitted_requests_finish(server):
    n = SLOTS["max"] + MAX_QUEUE + 3

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(_post(client, server, _chat("max", 40))) for _ in range(n)]
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    refused = [r for r in results if r.status_code == 429]
    served = [r for r in results if r.status_code == 200]
    assert len(refused) >= 1 and len(served) >= SLOTS["max"] + MAX_QUEUE - 1 and len(refused) + len(served) == n
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
    for r in served:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _wait_for(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_low_is_served_while_max_is_saturated(server):
    """Max's slot busy and a Max request queued: a Low request is still answered from Low's own slot.
    The Max requests are then abandoned (client gone), which cancels them and frees their pages."""

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            busy = [asyncio.create_task(_post(client, server, _chat("max", 1500))) for _ in range(SLOTS["max"] + 1)]
            saturated = await asyncio.to_thread(_wait_for, lambda: server.metric("jaxmoe_queue_depth", tier="max") >= 1)
            low = await _post(client, server, _chat("low", 6, "hi"))
            still_busy = server.metric("jaxmoe_requests_running", tier="max") == SLOTS["max"]
            for t in busy:
                t.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return saturated, low, still_busy

    saturated, low, still_busy = asyncio.run(main())
    assert saturated and low.status_code == 200 and still_busy
    assert _wait_for(lambda: server.metric("jaxmoe_requests_running", tier="max") == 0, 30)
    assert _wait_for(lambda: server.metric("jaxmoe_cache_pages_used") == 0, 10)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_min_tokens_keeps_the_answer_going(server, path):
    body = {**_chat("none", 12, "hi"), "min_tokens": 12}
    if _anthropic(path):
        body = {k: v for k, v in body.items() if k != "reasoning_effort"}
    r = httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    if _anthropic(path):
        assert out["stop_reason"] == "max_tokens" and out["usage"]["output_tokens"] == 12
    else:
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 12


def test_disconnect_mid_stream_frees_pages(server):
    body = {**_chat("max", 300), "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=server.headers()) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.metric("jaxmoe_cache_pages_used") == 0 and server.metric("jaxmoe_requests_running", tier="max") == 0:
            break
        time.sleep(0.2)
    assert server.metric("jaxmoe_cache_pages_used") == 0
    assert server.metric("jaxmoe_requests_running", tier="max") == 0


def test_metrics_export_every_tier(server):
    text = server.metrics()
    for tier in ("low", "high", "max"):
        assert f'jaxmoe_queue_depth{{tier="{tier}"}}' in text
        assert f'jaxmoe_requests_running{{tier="{tier}"}}' in text
    names = ("requests_total", "time_to_first_token_seconds", "generated_tokens_total", "cache_pages_used",
             "cache_pages_total", "prefix_cache_hit_tokens_total")  # fmt: skip
    for name in names:
        assert f"jaxmoe_{name}" in text
    assert server.metric("jaxmoe_cache_pages_total") > 0


def test_tls_with_a_test_certificate(run, tmp_path):
    import openai
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(cert_file)
    cert.private_key_pem.write_to_path(key_file)
    ca.cert_pem.write_to_path(ca_file)
    server = start_server(
        run.workdir, tmp_path, "--ssl-certfile", str(cert_file), "--ssl-keyfile", str(key_file),
        scheme="https", verify=str(ca_file),
    )  # fmt: skip
    try:
        http = openai.DefaultHttpxClient(verify=str(ca_file))
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS[0], http_client=http, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.base_url + "/health", timeout=10)  # not trusted without the test CA
    finally:
        stop_server(server)


def _cancelled(server, tier: str) -> float:
    try:
        return server.metric("jaxmoe_requests_total", tier=tier, status="cancelled")
    except KeyError:
        return 0.0


def test_abandoned_whole_and_queued_requests_are_cancelled(server):
    """A client that gives up on a whole (non-streamed) answer, running or still queued, cancels it:
    its slot, its queue place and its pages come back, and it is counted as cancelled."""
    before = _cancelled(server, "high")
    body = {**_chat("high", 3000), "min_tokens": 3000}  # ~a minute of decoding: never done within the timeout
    with pytest.raises(httpx.TimeoutException):

        async def main():
            async with httpx.AsyncClient(timeout=3) as client:
                await asyncio.gather(*(_post(client, server, body) for _ in range(SLOTS["high"] + 1)))

        asyncio.run(main())
    assert _wait_for(lambda: server.metric("jaxmoe_requests_running", tier="high") == 0, 10)
    assert _wait_for(lambda: server.metric("jaxmoe_queue_depth", tier="high") == 0, 10)
    assert _wait_for(lambda: server.metric("jaxmoe_cache_pages_used") == 0, 10)
    assert _cancelled(server, "high") >= before + 1
