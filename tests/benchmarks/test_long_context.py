"""benchmarks/long_context.py's sweep bookkeeping, with the runs themselves replaced by a stub
(a real sweep takes hours): every length runs in its own process, the fitted exponent, the HF
ratio, failures reported with their reason, and ``--results`` resuming a sweep for the same
measured code only (docs-only commits keep it). The prefill itself is tested by a short real run."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "long_context.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("long_context", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []

    def fake(*flags, timeout=None):  # seconds ~ tokens^2; HF fits 8192 tokens, 10x slower
        n = int(flags[flags.index("--tokens") + 1])
        calls.append(flags)
        if "--hf" in flags:
            if n > 8192:
                return {"failed": "exit 1: out of memory"}
            return {
                "benchmark": "long_context_hf_deepseek_v32",
                "tokens": n,
                "seconds": 10 * (n / 1024) ** 2,
                "peak_rss_gb": 2.0,
            }
        return {"benchmark": "long_context", "tokens": n, "seconds": (n / 1024) ** 2, "peak_rss_gb": 1.0, "code": "c"}

    monkeypatch.setattr(module, "_subprocess", fake)
    monkeypatch.setattr(module, "_code", lambda: "c")
    return module, calls


def _lines(out):
    return [json.loads(x) for x in out.splitlines()]


def test_sweep_fits_the_exponent_and_the_hf_ratio(bench, capsys):
    module, calls = bench
    module.sweep([1024, 2048, 4096], hf_timeout=1)
    lines = _lines(capsys.readouterr().out)
    assert [r["tokens"] for r in lines[:3]] == [1024, 2048, 4096]
    failed = [r for r in lines if "failed" in r]
    assert [r["tokens"] for r in failed] == [16384] and "out of memory" in failed[0]["failed"]
    summary = lines[-1]
    assert summary["benchmark"] == "long_context_sweep" and summary["time_exponent"] == pytest.approx(2.0)
    assert summary["hf_tokens"] == 8192 and summary["speedup_vs_hf"] == pytest.approx(10.0)


def test_results_file_resumes_a_sweep_for_the_same_code(bench, tmp_path, capsys):
    module, calls = bench
    results = tmp_path / "sweep.jsonl"
    module.sweep([1024, 2048], hf_timeout=1, results_file=results)
    first = len(calls)
    calls.clear()
    module.sweep([1024, 2048, 4096], hf_timeout=1, results_file=results)
    ran = [int(f[f.index("--tokens") + 1]) for f in calls if "--hf" not in f]
    assert ran == [4096] and first == 5  # 1024, 2048 and ours at the HF length (8192) were kept
    assert _lines(capsys.readouterr().out)[-1]["time_exponent"] == pytest.approx(2.0)
    # Other measured code (or uncommitted changes to it) reuses nothing.
    module._code = lambda: "d"
    calls.clear()
    module.sweep([1024], hf_timeout=1, results_file=results)
    assert [int(f[f.index("--tokens") + 1]) for f in calls if "--hf" not in f][0] == 1024


def test_code_hash_follows_the_measured_code_only(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("long_context", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    repo = tmp_path / "repo"
    for path in ("jaxmoe/model.py", "configs/tiny.py", "pyproject.toml", "README.md"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text("v1\n")

    def git(*args):
        ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", *ident, *args], cwd=repo, check=True, capture_output=True)

    def commit(path, text):
        (repo / path).write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", path)

    git("init", "-q")
    commit("README.md", "v1\n")
    monkeypatch.setattr(module, "ROOT", repo)
    first = module._code()
    assert first is not None and module._code() == first
    commit("README.md", "docs\n")  # not measured: kept
    assert module._code() == first
    (repo / "jaxmoe/model.py").write_text("v2\n")  # uncommitted model change: nothing to reuse
    assert module._code() is None
    commit("jaxmoe/model.py", "v2\n")
    second = module._code()
    assert second not in (None, first)
    monkeypatch.setenv("XLA_FLAGS", "--other")
    assert module._code() not in (None, second)
    monkeypatch.setattr(module, "ROOT", tmp_path)  # not a checkout
    assert module._code() is None


def test_short_real_run(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    results = tmp_path / "runs.jsonl"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "4096", "--results", str(results)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["tokens"] == 4096 and r["seconds"] > 0 and r["peak_rss_gb"] > 0 and r["context_shards"] == 8
    assert [json.loads(line) for line in results.read_text().splitlines()] == [r]  # kept for a sweep


def test_tokens_must_divide_over_the_shards():
    r = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "4095"], capture_output=True, text=True)
    assert r.returncode == 2 and "--tokens must be a multiple of the 8 context shards" in r.stderr
