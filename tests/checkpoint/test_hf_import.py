"""Logit parity with HF transformers for the three importable families, through the CLI.

Each test builds a tiny HF torch model with random weights (router correction bias and norm
weights included), ``save_pretrained``s it, runs ``jaxmoe convert hf`` and ``jaxmoe logits`` and
compares against torch's logits in fp32. Sequences are longer than the DSA top-k, so the
indexer's selection matters.
"""

import json

import numpy as np
import pytest
import torch
import transformers

from jaxmoe import cli

MAX_LOGIT_DIFF = 1e-4  # per-model fp32 tolerance

COMMON = dict(
    vocab_size=96,
    hidden_size=44,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=20,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    routed_scaling_factor=2.5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            **COMMON,
            num_hidden_layers=3,
            q_lora_rank=28,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            max_position_embeddings=128,
            rope_parameters=YARN,
        )
    )


def _deepseek_v32():
    return transformers.DeepseekV32ForCausalLM(
        transformers.DeepseekV32Config(
            **COMMON,
            num_hidden_layers=3,
            q_lora_rank=28,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            index_topk=16,
            index_head_dim=16,
            # 8 indexer heads: with few heads, many keys score exactly 0 (every ReLU off) and
            # top-k ties at the boundary make the selected set implementation-defined.
            index_n_heads=8,
            max_position_embeddings=128,
        )
    )


def _kimi_linear():
    common = {k: v for k, v in COMMON.items() if k != "routed_scaling_factor"}
    return transformers.KimiLinearForCausalLM(
        transformers.KimiLinearConfig(
            **common,
            num_hidden_layers=4,
            q_lora_rank=None,
            num_experts=8,
            num_experts_per_token=3,
            num_expert_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            linear_attn_config={
                "head_dim": 8,
                "num_heads": 4,
                "short_conv_kernel_size": 4,
                "kda_layers": [1, 2, 4],
                "full_attn_layers": [3],
            },
        )
    )


FAMILIES = {"deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32, "kimi_linear": _kimi_linear}


def _randomize(model, seed):
    """Random weights everywhere, not just where HF's init puts them: norms, biases, gates."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.dtype.is_floating_point or "inv_freq" in name:
                continue
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "A_log" in name:
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif "dt_bias" in name:
                p.copy_(torch.empty(p.shape).uniform_(-4.0, -1.0, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.eval()


def _run(argv):
    assert cli.main(argv) == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf(family, tmp_path):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.config._attn_implementation = "eager"
    _randomize(model, seed=1)
    model.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf/config.json").read_text())["model_type"] == family

    tokens = np.random.default_rng(2).integers(0, 96, (2, 41), dtype=np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.float().numpy()

    _run(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "jm")])
    np.save(tmp_path / "tokens.npy", tokens)
    _run(
        [
            "logits",
            "--checkpoint",
            str(tmp_path / "jm"),
            "--tokens",
            str(tmp_path / "tokens.npy"),
            "--out",
            str(tmp_path / "logits.npy"),
        ]
    )
    got = np.load(tmp_path / "logits.npy")
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.abs(got - want).max() <= MAX_LOGIT_DIFF, np.abs(got - want).max()


def test_unknown_model_type_is_refused(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli.main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "jm")]) == 1
    assert "model_type='llama'" in capsys.readouterr().err


def test_missing_tensor_is_named(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    _deepseek_v3().save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf/model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "hf/model.safetensors", metadata={"format": "pt"})
    assert cli.main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "jm")]) == 1
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in capsys.readouterr().err


def test_bad_tokens_are_refused(tmp_path, capsys):
    np.save(tmp_path / "tokens.npy", np.zeros((2, 3, 4), np.int32))
    with pytest.raises(SystemExit, match="integer \\[B, T\\]"):
        cli.main(
            [
                "logits",
                "--checkpoint",
                str(tmp_path),
                "--tokens",
                str(tmp_path / "tokens.npy"),
                "--out",
                str(tmp_path / "o.npy"),
            ]
        )
