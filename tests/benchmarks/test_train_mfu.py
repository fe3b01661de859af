"""benchmarks/train_mfu.py: a ``--quick`` run prints one JSON line with its keys, the same first
loss as HF transformers (the weights were imported correctly) and finite positive figures; bad
flags are refused naming the flag. No assertion on the times themselves."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "train_mfu.py"
MAX_LOSS_DIFF = 1e-4  # per-model fp32 tolerance
KEYS = (
    "benchmark",
    "tokens_per_step",
    "jaxmoe_tokens_per_s",
    "hf_tokens_per_s",
    "ratio",
    "model_flops_per_token",
    "peak_flops",
    "mfu",
    "first_loss_abs_diff",
    "devices",
    "mesh",
    "loadavg_1_5_15min",
)
POSITIVE = ("jaxmoe_tokens_per_s", "hf_tokens_per_s", "ratio", "model_flops_per_token", "peak_flops", "mfu")


def _load_script():
    spec = importlib.util.spec_from_file_location("train_mfu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_one_json_line():
    # 2 devices: a sharded step (mesh data=2) that compiles faster than 8 devices on 2 cores.
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--devices", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, out.stdout
    r = json.loads(lines[0])
    assert set(KEYS) <= set(r), sorted(set(KEYS) - set(r))
    assert r["benchmark"] == "train_mfu"
    assert r["mesh"] == {"data": 2}
    assert r["tokens_per_step"] == 8 * 32
    assert r["first_loss_abs_diff"] <= MAX_LOSS_DIFF
    # Random tokens over a 512-word vocabulary: the untrained model's loss is close to ln(512).
    assert abs(r["first_loss"] - math.log(512)) < 0.5
    for k in POSITIVE:
        assert math.isfinite(r[k]) and r[k] > 0, (k, r[k])


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--mesh", "data=3"], "--mesh"),
        (["--mesh", "batch=8"], "--mesh"),
        (["--d-model", "100"], "--d-model"),
        (["--layers", "1"], "--layers"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _load_script().parse_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err
