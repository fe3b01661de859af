"""The README's main command, ``bash launch/local.sh``, end to end with a short step count.

Trains the tiny model on the 8-device CPU mesh through both DSA stages (dense warm-up, then
sparse), checkpoints, exports MXFP4, resumes, and samples.
"""

import json
import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(workdir, *flags):
    env = dict(os.environ, JAXMOE_WORKDIR=str(workdir), JAXMOE_EXTRAS="test")  # the venv test.sh made
    env.pop("XLA_FLAGS", None)  # local.sh sets the 8-device mesh itself
    return subprocess.run(
        ["bash", str(ROOT / "launch" / "local.sh"), "--no-progress", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )


def test_local_sh_trains_saves_and_samples(tmp_path):
    flags = (
        "--config.steps=4",
        "--config.dsa.warmup_steps=2",
        "--config.eval_every=2",
        "--config.checkpoint_every=2",
        "--config.data.max_bytes=400000",
        "--config.data.heldout_fraction=0.2",
        "--config.eval_batches=1",
    )
    out = _run(tmp_path / "run", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert {"step", "loss", "tokens_per_s", "mfu", "lr", "grad_norm"} <= set(records[-1])
    assert {r["stage"] for r in records if "stage" in r} == {"warmup", "main"}
    assert (tmp_path / "run" / "export_mxfp4").is_dir()
    assert re.search(r"== held-out loss \d+\.\d{3} at step 4: (not yet )?below the 3.5 threshold", out.stdout)
    sample = out.stdout.split("== jaxmoe generate", 1)[1].split("\n", 1)[1]
    assert sample.strip(), out.stdout[-2000:]

    # Again with more steps: resumes from step 4 instead of starting over.
    more = _run(tmp_path / "run", *flags[1:], "--config.steps=6")
    assert more.returncode == 0, more.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps[-2:] == [5, 6] and len(steps) == len(set(steps)), steps  # steps 1-4 were not run again
