"""Two processes x 4 CPU devices (``jax.distributed`` through a local coordinator) train the test
config to the same losses as one process x 8 devices (the ``run`` fixture)."""

import json
import subprocess
import sys

import numpy as np
from conftest import ROOT, TINY_TRAIN  # noqa: F401 (pytest puts this directory on sys.path)
from tiny_run import coordinator_flags, process_env

from jaxmoe.checkpoint.io import load_model


def test_two_processes_equal_one(run, flags, tmp_path):
    workdir = tmp_path / "two"
    env = process_env(4)
    argv = [sys.executable, "-m", "jaxmoe", "train", "--config", TINY_TRAIN, "--workdir", str(workdir), *flags]
    argv += ["--no-progress", *coordinator_flags(2)]
    procs = [
        subprocess.Popen(
            [*argv, "--process_id", str(i)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    # Process 0 writes the metrics and prints them; process 1 prints no record (gloo logs its own lines).
    records_out = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outs]
    assert records_out[1] == []
    stdout = records_out[0]
    assert stdout[-1]["done"] and stdout[-1]["step"] == 6
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    # Both processes saved (Orbax, multi-process) the same checkpoints.
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]
    for key in ("loss", "heldout_loss"):
        two = {r["step"]: r[key] for r in records if key in r}
        one = run.values(key)
        assert sorted(two) == sorted(one)
        # Cross-process all-reduces (gloo) sum in another order than in-process ones: fp32 rounding, not bits.
        np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=2e-6, atol=0)
    assert [r["expert_load"] for r in records] == [run.values("expert_load")[s] for s in range(1, 7)]
    # The MXFP4 export (each process quantizing and writing its own shards) restores.
    export_cfg, _ = load_model(workdir / "export_mxfp4")
    assert export_cfg.model.mxfp4_weights == ("w_gate", "w_up", "w_down")
    assert stdout[-1]["export"] == str(workdir / "export_mxfp4")
