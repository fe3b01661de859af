"""Peak host memory of streaming conversion on a synthetic deepseek_v3-shaped HF checkpoint.

    .venv/bin/python benchmarks/convert_memory.py                  # ~4.8 GB float32 source
    .venv/bin/python benchmarks/convert_memory.py --layers 2 --experts 16   # quick

Writes an HF folder (config.json, one safetensors shard per layer, random float32 weights) to a
temporary directory, then runs, each in a fresh process whose peak RSS is read back
(``os.wait4``'s rusage of that child):
``jaxmoe convert hf SRC Q --quant mxfp4`` and ``jaxmoe convert dequantize Q F``. The bound is
twice the largest float tensor (a stacked routed-expert weight ``[E, D, F]``) plus 1 GiB.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

GIB = 1 << 30


def hf_config(a) -> dict:
    return dict(
        model_type="deepseek_v3",
        vocab_size=a.vocab,
        hidden_size=a.dim,
        intermediate_size=4 * a.dim,
        moe_intermediate_size=a.ffw,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=a.experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
    )


def write_hf(folder: pathlib.Path, a) -> int:
    """Writes the synthetic checkpoint shard by shard; returns its size in bytes."""
    rng = np.random.default_rng(0)
    D, F, E, N = a.dim, a.ffw, a.experts, 8

    def w(*shape):
        return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    weight_map, total = {}, 0

    def shard(name: str, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, folder / name)
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())

    shard(
        "model-embed.safetensors",
        {"model.embed_tokens.weight": w(a.vocab, D), "lm_head.weight": w(a.vocab, D), "model.norm.weight": w(D)},
    )
    for i in range(a.layers):
        p = f"model.layers.{i}."
        t = {
            p + "input_layernorm.weight": w(D),
            p + "post_attention_layernorm.weight": w(D),
            p + "self_attn.q_a_proj.weight": w(128, D),
            p + "self_attn.q_a_layernorm.weight": w(128),
            p + "self_attn.q_b_proj.weight": w(N * 48, 128),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(128 + 16, D),
            p + "self_attn.kv_a_layernorm.weight": w(128),
            p + "self_attn.kv_b_proj.weight": w(N * 64, 128),
            p + "self_attn.o_proj.weight": w(D, N * 32),
            p + "mlp.gate.weight": w(E, D),
            p + "mlp.gate.e_score_correction_bias": w(E),
            p + "mlp.shared_experts.gate_proj.weight": w(F, D),
            p + "mlp.shared_experts.up_proj.weight": w(F, D),
            p + "mlp.shared_experts.down_proj.weight": w(D, F),
        }
        for e in range(E):
            t[f"{p}mlp.experts.{e}.gate_proj.weight"] = w(F, D)
            t[f"{p}mlp.experts.{e}.up_proj.weight"] = w(F, D)
            t[f"{p}mlp.experts.{e}.down_proj.weight"] = w(D, F)
        shard(f"model-layer{i}.safetensors", t)
        del t
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf_config(a)))
    return total


def run_measured(argv: list[str]) -> tuple[int, float]:
    """Runs ``argv`` in a child; returns (that child's peak RSS in bytes, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage, not the max over all children
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} failed with status {os.waitstatus_to_exitcode(status)}")
    return usage.ru_maxrss * 1024, seconds  # ru_maxrss is in KiB on Linux


def _du(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffw", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--workdir", type=pathlib.Path, default=None, help="default: a fresh temporary directory")
    ap.add_argument("--skip-dequantize", action="store_true")
    a = ap.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="convert_memory_", dir=a.workdir))
    try:
        src = work / "hf"
        src.mkdir()
        t0 = time.perf_counter()
        source_bytes = write_hf(src, a)
        gen_s = time.perf_counter() - t0
        largest = 4 * max(a.experts * a.dim * a.ffw, a.vocab * a.dim)
        bound = 2 * largest + GIB
        cli = [sys.executable, "-m", "jaxmoe", "convert"]
        hf_peak, hf_s = run_measured([*cli, "hf", str(src), str(work / "q"), "--quant", "mxfp4", "--no-progress"])
        out = {
            "benchmark": "convert_memory",
            "source_bytes": source_bytes,
            "largest_tensor_bytes": largest,
            "bound_bytes": bound,
            "hf_to_mxfp4_peak_rss_bytes": hf_peak,
            "hf_to_mxfp4_seconds": round(hf_s, 1),
            "mxfp4_bytes_on_disk": _du(work / "q"),
            "generate_seconds": round(gen_s, 1),
        }
        ok = hf_peak <= bound
        if not a.skip_dequantize:
            dq_peak, dq_s = run_measured([*cli, "dequantize", str(work / "q"), str(work / "f"), "--no-progress"])
            out.update(dequantize_peak_rss_bytes=dq_peak, dequantize_seconds=round(dq_s, 1))
            ok = ok and dq_peak <= bound
        out["within_bound"] = ok
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main()))
