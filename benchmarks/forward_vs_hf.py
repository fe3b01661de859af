"""Forward tokens/s of jaxmoe vs HF transformers on the same DeepSeek-V3-architecture weights.

    python benchmarks/forward_vs_hf.py [--tokens 4096] [--repeats 3]

Both run on this machine's CPU in the same process, fp32, on one sequence; the weights are a
tiny DeepSeek-V3 built in torch, saved with ``save_pretrained`` and imported with jaxmoe's HF
importer. Prints one JSON line with both throughputs, their ratio, and the max logit difference.
"""

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from jaxmoe.checkpoint.hf_import import import_hf

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def _best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).eval()
    hf.config._attn_implementation = "sdpa"
    with torch.no_grad():
        for name, t in hf.named_buffers():
            if "e_score_correction_bias" in name:
                t.copy_(0.05 * torch.randn(t.shape))
    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (1, args.tokens), dtype=np.int32)

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        _, model = import_hf(d)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))
    jax_tokens = jax.device_put(tokens)
    got = np.asarray(forward(state, jax_tokens))  # compile + warm-up
    jax_s = _best_of(lambda: forward(state, jax_tokens).block_until_ready(), args.repeats)

    torch_tokens = torch.from_numpy(tokens).long()
    with torch.no_grad():
        want = hf(torch_tokens).logits.numpy()  # warm-up
        hf_s = _best_of(lambda: hf(torch_tokens), args.repeats)

    print(
        json.dumps(
            {
                "benchmark": "forward_vs_hf",
                "tokens": args.tokens,
                "jaxmoe_tokens_per_s": round(args.tokens / jax_s, 1),
                "hf_tokens_per_s": round(args.tokens / hf_s, 1),
                "ratio": round(hf_s / jax_s, 2),
                "hf_attn_implementation": "sdpa",
                "max_abs_logit_diff": float(np.abs(got - want).max()),
            }
        )
    )


if __name__ == "__main__":
    main()
