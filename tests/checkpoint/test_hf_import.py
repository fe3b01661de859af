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
from hf_models import FAMILIES, deepseek_v3, random_model

from jaxmoe import cli

MAX_LOGIT_DIFF = 1e-4  # per-model fp32 tolerance


def _run(argv):
    assert cli.main(argv) == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf(family, tmp_path):
    model = random_model(family)
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
    deepseek_v3().save_pretrained(tmp_path / "hf")
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
