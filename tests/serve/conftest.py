"""One live ``jaxmoe serve`` over the shared tiny run, started once per session on 127.0.0.1.

The server runs in its own process (stopped by its pid at the end), with two API keys, small
thinking budgets (low 8, high 16, max 32) so that budget tests run in seconds, one running slot
and two queue places per tier so that overload is easy to reach.
"""

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest
from tiny_run import free_port

KEYS = ("sk-test-alpha", "sk-test-beta")
BUDGETS = {"low": 8, "high": 16, "max": 32}
SLOTS = {"low": 1, "high": 1, "max": 1}
MAX_QUEUE = 2
MODEL = "tiny-test"
START_TIMEOUT_S = 600


@dataclasses.dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    log: pathlib.Path
    key: str = KEYS[0]

    def headers(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.key}"}

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", headers=self.headers(), timeout=10, verify=False).text

    def metric(self, name: str, **labels) -> float:
        """The value of one sample of ``/metrics`` (labels must match exactly)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in self.metrics().splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            metric, _, rest = key.partition("{")
            got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if metric == name and got == want:
                return float(value)
        raise KeyError(f"{name}{{{want}}} not in /metrics")


def start_server(workdir, tmp_path: pathlib.Path, *extra: str, scheme: str = "http", verify=None) -> Server:
    keys = tmp_path / "keys.txt"
    keys.write_text("# test keys\n" + "\n".join(KEYS) + "\n")
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    argv = [
        sys.executable, "-m", "jaxmoe", "serve", "--checkpoint", str(workdir), "--port", str(port),
        "--api-keys", str(keys), "--model-name", MODEL,
        "--thinking-budgets", ",".join(f"{t}={n}" for t, n in BUDGETS.items()),
        "--tier-slots", ",".join(f"{t}={n}" for t, n in SLOTS.items()), "--max-queue", str(MAX_QUEUE),
        "--cache-gb", "0.02", "--page-size", "8", "--step-tokens", "64", "--chunk-size", "32",
        "--warmup-context", "64",
        "--request-timeout", "120", "--log-level", "warning", *extra,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    env.pop("JAXMOE_API_KEYS", None)
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(f"{scheme}://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jaxmoe serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2, verify=verify if verify else True).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"jaxmoe serve did not come up in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=20)


@pytest.fixture(scope="session")
def server(run, tmp_path_factory):
    s = start_server(run.workdir, tmp_path_factory.mktemp("serve"))
    yield s
    stop_server(s)


@pytest.fixture
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.key, max_retries=0, timeout=120)


@pytest.fixture
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key=server.key, max_retries=0, timeout=120)
