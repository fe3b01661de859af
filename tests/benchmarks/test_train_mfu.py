"""benchmarks/train_mfu.py: a ``--quick`` run prints one JSON line with its keys, the same first
loss as HF transformers (the weights were imported correctly) and the model FLOPs per token that
HF's own parameters give; bad flags are refused naming the flag. No assertion on the times or the
figures made from them (tokens/s, ratio, MFU): they move with the machine's load."""

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


def _load_script():
    spec = importlib.util.spec_from_file_location("train_mfu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hf_flops_per_token(shape: dict, seq: int) -> float:
    """6 x the activated matmul weights of the HF model (routed experts at K / E, the embedding lookup
    no matmul) + 3 x the causal attention's ``2 N_h (H_qk + H_v)`` per visible key, per layer."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    config = transformers.DeepseekV3Config(**shape)
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(config)
    routed = config.num_experts_per_tok / config.n_routed_experts
    weights = sum(
        p.numel() * (routed if ".mlp.experts." in name else 1)
        for name, p in hf.named_parameters()
        if p.dim() >= 2 and "embed_tokens" not in name
    )
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    attention = 2 * config.num_attention_heads * (qk + config.v_head_dim) * (seq + 1) / 2
    return 6 * weights + 3 * attention * config.num_hidden_layers


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
    script = _load_script()
    quick = script.PRESETS["quick"]
    shape = script.hf_shape(quick["d_model"], quick["layers"], quick["vocab"], quick["seq"])
    assert r["model_flops_per_token"] == _hf_flops_per_token(shape, quick["seq"])
    assert len(r["jaxmoe_step_s"]) == len(r["hf_step_s"]) == quick["steps"]


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
