"""Two processes x 4 CPU devices (``jax.distributed`` through a local coordinator) decode a request
file to the same tokens as one process x 8 devices, the weights sharded expert 2 x tensor 4.

Process 0 schedules and broadcasts each step's arrays; process 1 runs the same jitted steps."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from tiny_run import coordinator_flags

from jaxmoe.checkpoint.io import save_model
from jaxmoe.config import load_config
from jaxmoe.model import create_model

ROOT = pathlib.Path(__file__).parents[2]
MESH = "expert=2,tensor=4"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = load_config(ROOT / "configs/tiny.py")
    path = tmp_path_factory.mktemp("mp") / "model"
    save_model(create_model(cfg.model, seed=0), cfg, path)
    return path


def test_two_processes_equal_one(checkpoint, tmp_path):
    rng = np.random.default_rng(0)
    lines = [
        {"prompt_ids": rng.integers(0, 512, n).tolist(), "max_tokens": 8, "temperature": t, "seed": i}
        for i, (n, t) in enumerate([(5, 0.0), (23, 0.8), (40, 0.0), (12, 1.0)])
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["generate", "--checkpoint", str(checkpoint), "--requests", str(tmp_path / "in.jsonl"), "--mesh", MESH]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    # Both runs in fresh processes: one x 8 devices, then two x 4.
    one = [sys.executable, "-m", "jaxmoe", *argv, "--out", str(tmp_path / "one.jsonl"), "--no-progress"]
    eight = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(one, env=eight, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    two = [sys.executable, "-m", "jaxmoe", *argv, "--out", str(tmp_path / "two.jsonl"), "--no-progress"]
    two += coordinator_flags(2)
    procs = [
        subprocess.Popen(
            [*two, "--process_id", str(i)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    one = [json.loads(x) for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    assert all(len(o["output_ids"]) == 8 for o in one)
    # Cross-process all-reduces (gloo) sum in another order: fp32 rounding, not bits.
    np.testing.assert_allclose([o["logprobs"] for o in two], [o["logprobs"] for o in one], atol=1e-4)
