"""Decode throughput of the inference engine against HF transformers ``generate``, and its cache facts.

    python benchmarks/decode.py [--new-tokens 64] [--long 65536]

Same weights on both sides: tiny DeepSeek-V3 and Kimi-Linear architecture models built in torch,
saved with ``save_pretrained`` and imported with jaxmoe's HF importer. The same 16 prompts of
mixed lengths, greedy, ``--new-tokens`` each:

- ``engine_tokens_per_s``: all 16 submitted at once (a warm run: the step's programs compiled);
- ``hf_batched_tokens_per_s``: one ``generate`` call over the 16, left-padded;
- ``hf_single_tokens_per_s``: ``generate`` one prompt at a time;
- ``decode_step_ratio_64k_over_1k``: one decode step of a sequence holding ``--long`` cached
  tokens over the same at 1,024 (the pools hold the positions; the step reads them all); the
  ``_batch16`` figures: the same for 16 such sequences at once;
- ``cache_bytes_over_ideal``: page bytes held by running sequences over their live tokens' bytes,
  averaged over the steps of the mixed-length run;
- ``turn2_prefill_over_new``: prefill tokens computed for turn 2 of a conversation (its prompt is
  turn 1's prompt + reply + a new message) over the new tokens of turn 2.

Prints one JSON line per architecture, and nothing else on stdout.
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
import transformers

from jaxmoe.checkpoint.hf_import import import_hf
from jaxmoe.inference import Engine, EngineConfig, Request
from jaxmoe.inference.forward import Rows
from jaxmoe.inference.sampler import RowSampling

COMMON = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    first_k_dense_replace=1,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=1,
)


def deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        **COMMON,
        num_hidden_layers=4,
        q_lora_rank=96,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return transformers.DeepseekV3ForCausalLM(cfg)


def kimi_linear():
    cfg = transformers.KimiLinearConfig(
        **COMMON,
        num_hidden_layers=4,
        q_lora_rank=None,
        num_experts=16,
        num_experts_per_token=4,
        num_expert_group=4,
        topk_group=2,
        linear_attn_config={
            "head_dim": 32,
            "num_heads": 8,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
        },
    )
    return transformers.KimiLinearForCausalLM(cfg)


ARCHS = {"deepseek_v3": deepseek_v3, "kimi_linear": kimi_linear}
PROMPT_LENGTHS = (16, 48, 96, 200, 320, 24, 512, 64, 150, 280, 32, 400, 80, 120, 256, 40)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, COMMON["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]


def _hf_generate(hf, prompts, new_tokens, batched):
    with torch.no_grad():
        if not batched:
            for p in prompts:
                hf.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                )
            return
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def _engine(model, **kw):
    config = dict(cache_bytes=1 << 30, max_seqs=16, step_tokens=512, chunk_size=256) | kw
    return Engine(model, EngineConfig(**config), eos_id=None)


def _engine_run(model, prompts, new_tokens):
    """(seconds of a warm run, mean cache bytes over ideal during it)."""
    requests = [Request(tuple(p), max_tokens=new_tokens) for p in prompts]
    _engine(model).generate(requests)  # compiles every bucket the run meets
    engine = _engine(model)
    ids = [engine.submit(r) for r in requests]
    ratios = []
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        live = sum(s.computed for s in engine.scheduler.running)
        held = sum(len(s.pages) for s in engine.scheduler.running)
        if live:
            ratios.append(held * engine.spec.bytes_per_page / (live * engine.spec.token_bytes))
    seconds = time.perf_counter() - t0
    assert all(len(engine.completion(i).output_ids) == new_tokens for i in ids)
    return seconds, float(np.mean(ratios))


def _decode_step_seconds(engine, cached, batch=16, repeats=3):
    """One decode step of ``batch`` sequences each holding ``cached`` positions (pages as if prefilled)."""
    P = engine.config.page_size
    M = 1 << (-(-(cached + 1) // P) - 1).bit_length()
    pages = np.zeros((batch, M), np.int32)
    per_seq = -(-(cached + 1) // P)
    for b in range(batch):
        pages[b, :per_seq] = 1 + (np.arange(per_seq) + b * per_seq) % (engine.spec.num_pages - 1)
    rows = Rows(
        np.ones((batch, 1), np.int32),
        np.full((batch,), cached, np.int32),
        np.ones((batch,), np.int32),
        pages,
        np.arange(batch, dtype=np.int32),
    )
    sampling = RowSampling(
        np.zeros(batch, np.float32),
        np.ones(batch, np.float32),
        np.zeros(batch, np.int32),
        np.zeros(batch, np.uint32),
        np.zeros(batch, np.int32),
    )
    engine.run_arrays((rows,), sampling)[0].block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.run_arrays((rows,), sampling)[0].block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def _turn2_ratio(model, prompts, new_tokens):
    engine = _engine(model)
    first = engine.generate([Request(tuple(prompts[3]), max_tokens=new_tokens, tenant="t")])[0]
    history = tuple(prompts[3]) + tuple(first.output_ids)
    turn2 = history + tuple(prompts[5])
    before = engine.stats["prefill_tokens"]
    engine.generate([Request(turn2, max_tokens=new_tokens, tenant="t")])
    return (engine.stats["prefill_tokens"] - before) / (len(turn2) - len(history))


def run(arch, new_tokens, long):
    torch.manual_seed(0)
    hf = ARCHS[arch]().eval()
    hf.config._attn_implementation = "sdpa" if arch == "deepseek_v3" else "eager"
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        _, model = import_hf(d)
    prompts = _prompts()
    total = len(prompts) * new_tokens

    engine_s, cache_ratio = _engine_run(model, prompts, new_tokens)
    t0 = time.perf_counter()
    _hf_generate(hf, prompts, new_tokens, batched=True)
    hf_batched_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _hf_generate(hf, prompts, new_tokens, batched=False)
    hf_single_s = time.perf_counter() - t0

    pool = _engine(model, cache_bytes=int(2.5 * 16 * (long + 64) * _engine(model).spec.token_bytes))
    short_s, long_s = _decode_step_seconds(pool, 1024), _decode_step_seconds(pool, long)
    short_1, long_1 = _decode_step_seconds(pool, 1024, batch=1), _decode_step_seconds(pool, long, batch=1)
    return {
        "benchmark": "decode",
        "arch": arch,
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "engine_tokens_per_s": round(total / engine_s, 1),
        "hf_batched_tokens_per_s": round(total / hf_batched_s, 1),
        "hf_single_tokens_per_s": round(total / hf_single_s, 1),
        "ratio_vs_hf_batched": round(hf_batched_s / engine_s, 2),
        "ratio_vs_hf_single": round(hf_single_s / engine_s, 2),
        f"decode_step_ratio_{long // 1024}k_over_1k": round(long_1 / short_1, 2),
        "decode_step_s_1k": round(short_1, 5),
        f"decode_step_s_{long // 1024}k": round(long_1, 5),
        f"decode_step_ratio_{long // 1024}k_over_1k_batch16": round(long_s / short_s, 2),
        "decode_step_s_1k_batch16": round(short_s, 5),
        f"decode_step_s_{long // 1024}k_batch16": round(long_s, 5),
        "cache_bytes_over_ideal": round(cache_ratio, 4),
        "turn2_prefill_over_new": round(_turn2_ratio(model, prompts, new_tokens), 4),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long", type=int, default=65536, help="cached tokens of the long decode step (default 64K)")
    p.add_argument("--arch", choices=sorted(ARCHS), action="append", help="default: both")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    for arch in args.arch or sorted(ARCHS):
        print(json.dumps(run(arch, args.new_tokens, args.long)), flush=True)


if __name__ == "__main__":
    main()
