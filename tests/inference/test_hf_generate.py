"""Greedy decode through the engine equals HF transformers' greedy ``generate``, token for token.

For each importable family a tiny HF model with random weights is saved, converted with
``jaxmoe convert hf`` and decoded with ``jaxmoe generate --requests`` (every request of the file
batched together in one engine); HF decodes each prompt alone with its own KV cache. DSA prompts
and outputs are longer than the indexer's top-k (16), so the selection matters. fp32. Tokens are
compared up to the first step where HF's two best logits are within 1e-4 (the per-model tolerance):
there fp32 rounding may pick either, and the continuations part.
"""

import json

import numpy as np
import pytest
import torch
from hf_models import FAMILIES, random_model

from jaxmoe import cli

PROMPT_LENGTHS = (21, 9, 34, 17)
NEW_TOKENS = 24
TIE = 1e-4


def _hf_greedy(model, prompt):
    """HF's greedy tokens and, per step, the gap between its two best logits."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt)),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), gaps


def _agreed_prefix(gaps):
    """Steps up to the first fp32 near-tie (top-2 gap below the 1e-4 model tolerance): a tie may break either way."""
    return next((i for i, g in enumerate(gaps) if g < TIE), len(gaps))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_greedy_equals_hf_generate(family, tmp_path):
    model = random_model(family)
    # No eos: both sides decode NEW_TOKENS tokens (HF would stop at its eos id, ours ignores it).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(tmp_path / "hf")
    assert cli.main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "jm")]) == 0

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 96, n).tolist() for n in PROMPT_LENGTHS]
    lines = [{"prompt_ids": p, "max_tokens": NEW_TOKENS, "ignore_eos": True} for p in prompts]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["generate", "--checkpoint", str(tmp_path / "jm"), "--requests", str(tmp_path / "in.jsonl")]
    assert cli.main(argv + ["--out", str(tmp_path / "out.jsonl")]) == 0
    got = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]

    compared = 0
    for prompt, out in zip(prompts, got):
        assert out["finish_reason"] == "length" and out["text"] is None and len(out["output_ids"]) == NEW_TOKENS
        want, gaps = _hf_greedy(model, prompt)
        n = _agreed_prefix(gaps)
        assert out["output_ids"][:n] == want[:n]
        compared += n
    assert compared >= 0.9 * NEW_TOKENS * len(prompts), compared  # near-ties are rare: most tokens compared
