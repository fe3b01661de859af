"""``jaxmoe info``: sizes of full-scale configs from eval_shape, checked against their targets."""

import json
import pathlib

import pytest

from jaxmoe import cli
from jaxmoe.config import load_config
from jaxmoe.info import model_info

ROOT = pathlib.Path(__file__).parent.parent


def test_target_sizes(capsys):
    assert cli.main(["info", "--config", str(ROOT / "configs/target.py")]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(info["total_params"] / 2.8e12 - 1) <= 0.01, info
    assert abs(info["active_params"] / 104e9 - 1) <= 0.02, info
    assert info["layers"] == {"mla": 3, "dsa": 24, "kda": 69}
    assert info["max_context"] == 1_048_576
    assert info["kv_cache_bytes_per_token"] > 0 and info["state_bytes_per_sequence"] > 0


@pytest.mark.parametrize(
    "name, total, total_rel, active, active_rel",
    [
        ("deepseek_v3", 671e9, 0.01, 37e9, 0.02),  # the technical report's 671B / 37B
        ("kimi_linear", 48e9, 0.03, 3e9, 0.2),  # published as "48B-A3B", rounded to whole billions
    ],
)
def test_public_family_sizes(name, total, total_rel, active, active_rel):
    """Our counting reproduces the published sizes of the real models (a check of the counter)."""
    info = model_info(load_config(ROOT / f"configs/{name}.py"))
    assert abs(info["total_params"] / total - 1) <= total_rel, info
    assert abs(info["active_params"] / active - 1) <= active_rel, info


def test_kv_cache_bytes_deepseek_v3():
    # MLA caches the 512-d latent and the 64-d RoPE key per token per layer, bf16.
    info = model_info(load_config(ROOT / "configs/deepseek_v3.py"))
    assert info["kv_cache_bytes_per_token"] == 61 * (512 + 64) * 2
    assert info["state_bytes_per_sequence"] == 0


def test_mxfp4_experts_count_logical_parameters():
    """Packing the routed experts in MXFP4 changes bytes, not the parameter count."""
    import dataclasses

    cfg = load_config(ROOT / "configs/target.py")
    packed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mxfp4_weights=("w_gate", "w_up", "w_down")))
    a, b = model_info(cfg), model_info(packed)
    assert (a["total_params"], a["active_params"]) == (b["total_params"], b["active_params"])
