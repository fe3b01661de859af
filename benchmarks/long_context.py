"""Long-context prefill of ``configs/long_context.py`` (1 ``dsa`` : 3 ``kda`` layers) on 8 CPU devices.

    python benchmarks/long_context.py --tokens 1048576        # one JSON line
    python benchmarks/long_context.py --sweep                 # 64K..1M, exponent, HF deepseek_v32 ratio
    python benchmarks/long_context.py --sweep --results F     # the same, resumable: lines kept in F
    python benchmarks/long_context.py --tokens N --results F  # one length, kept in F for a sweep
    python benchmarks/long_context.py --memory --tokens 65536 # per-device memory vs context size P

Prefill: the whole sequence through every layer, the sequence split over the ``context`` mesh
axis (8 fake devices of this machine's CPU), then the next-token logits of the last position.
``seconds`` excludes compilation (``compile_s``); ``peak_rss_gb`` is the process's peak resident
memory, compilation included. ``--sweep`` runs each length in its own process (so each peak is
its own), fits ``seconds ~ tokens^exponent``, and times HF transformers' ``deepseek_v32`` with
the same dims (all layers ``dsa``; HF has no ``kda``) at the longest length it fits, against
this model at that length; with ``--results FILE`` it appends every line there and skips the
lengths FILE already holds for the same measured code (each line records ``code``, a hash of the
committed model code, configs and pins, this script's prefill and its XLA and malloc settings;
commits elsewhere keep it, uncommitted changes there reuse nothing), so an interrupted sweep
resumes. ``--memory`` compiles
the prefill for context axis sizes 1, 2, 4, 8 (each on a mesh of exactly P devices) and reports
XLA's per-device memory analysis.
"""

import os
import sys

# glibc malloc, read at process start: with the default per-thread arenas and its rising mmap
# threshold, the freed host buffers of XLA:CPU's device threads stay resident: a 1M-token prefill
# held 6.5 GB in 52 arenas and mid-size maps beside its 10.5 GB of XLA temporaries (18.2 GB at
# 23 minutes). A fixed threshold maps large buffers and unmaps them on free. Values the caller
# set win.
MALLOC = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}
if __name__ == "__main__" and any(k not in os.environ for k in MALLOC):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**MALLOC, **os.environ})

# XLA:CPU's YNNPACK fusions (dots, reductions, elementwise ops run through XNNPACK's YNN on a
# Slinky thread pool) hold memory for every task they enqueue until the execution ends: 8
# devices scoring a 1M-token context in one execution grew by ~0.2 GB/min (a jemalloc heap profile put the
# growth in ``xla::cpu::SlinkyThreadPool::enqueue``). XLA's own kernels do not grow, and ran the
# 64K prefill faster here (117 s against 135 s). Flags the caller set win.
XLA_DEFAULTS = {"--xla_force_host_platform_device_count": "8", "--xla_cpu_experimental_ynn_fusion_type": ""}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags, *(f"{k}={v}" for k, v in XLA_DEFAULTS.items() if k not in _flags)]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "long_context.py"
SWEEP = (65536, 131072, 262144, 524288, 1048576)
HF_LENGTHS = (16384, 8192, 4096)  # tried longest first until one fits


def _peak_rss_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)


def _prefill(cfg, mesh):
    """A jitted ``(state, tokens[1, T]) -> logits[1, V]`` and the model's state, placed on ``mesh``."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from jaxmoe.model import create_model  # noqa: PLC0415
    from jaxmoe.nn import dense  # noqa: PLC0415

    model = create_model(cfg.model, mesh=mesh)
    graphdef, state = nnx.split(model)

    def prefill(state, tokens):
        m = nnx.merge(graphdef, state)
        h = m.hidden(tokens)  # [1, T, D], T split over context
        return dense("BD,DV->BV", h[:, -1], m.lm_head)  # only the next token's logits: no [T, V]

    return jax.jit(prefill), state


def _tokens(n, mesh):
    import jax  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    ids = np.random.default_rng(0).integers(0, 512, (1, n), dtype=np.int32)
    return jax.device_put(ids, NamedSharding(mesh, PartitionSpec(None, "context")))


def run_jaxmoe(n: int) -> dict:
    import jax  # noqa: PLC0415

    from jaxmoe.config import load_config  # noqa: PLC0415
    from jaxmoe.sharding import make_mesh  # noqa: PLC0415

    cfg = load_config(CONFIG)
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        prefill, state = _prefill(cfg, mesh)
        tokens = _tokens(n, mesh)
        t0 = time.perf_counter()
        compiled = prefill.lower(state, tokens).compile()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = compiled(state, tokens).block_until_ready()
        seconds = time.perf_counter() - t0
    assert np.isfinite(np.asarray(logits)).all()
    return {
        "benchmark": "long_context",
        "tokens": n,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(n / seconds, 1),
        "peak_rss_gb": _peak_rss_gb(),
        "compile_s": round(compile_s, 1),
        "layer_kinds": list(cfg.model.layer_kinds),
        "topk": cfg.model.indexer.topk,
        "context_shards": cfg.mesh.context,
        "devices": f"8 fake CPU devices on {os.cpu_count()} cores",
        "commit": _commit(),
        "code": _code(),
    }


def run_memory(n: int) -> dict:
    """Per-device memory (XLA compiled memory analysis) of the prefill on P = 1, 2, 4, 8 devices, all on context."""
    import jax  # noqa: PLC0415

    from jaxmoe.config import load_config  # noqa: PLC0415
    from jaxmoe.sharding import make_mesh  # noqa: PLC0415

    cfg = load_config(CONFIG)
    temp, args = {}, {}
    for p in (1, 2, 4, 8):
        # Exactly P devices, all on `context`: spare devices would hold copies of the batch-1
        # sequence (or split only the token-local MoE), which measures something else.
        mesh_cfg = dataclasses.replace(cfg.mesh, data=1, fsdp=1, expert=1, context=p, tensor=1)
        mesh = make_mesh(mesh_cfg, devices=jax.devices()[:p])
        with jax.set_mesh(mesh):
            prefill, state = _prefill(cfg, mesh)
            tokens = jax.ShapeDtypeStruct((1, n), np.int32, sharding=_tokens(1 * p, mesh).sharding)
            analysis = prefill.lower(state, tokens).compile().memory_analysis()
        temp[p] = int(analysis.temp_size_in_bytes)
        args[p] = int(analysis.argument_size_in_bytes)
    return {
        "benchmark": "long_context_memory",
        "tokens": n,
        "temp_bytes_per_device": temp,
        "argument_bytes_per_device": args,
        "temp_p1_over_p8": round(temp[1] / temp[8], 2),
    }


def _hf_config(cfg, n):
    import transformers  # noqa: PLC0415

    m = cfg.model
    return transformers.DeepseekV32Config(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.moe.dense_ffw_dim,
        moe_intermediate_size=m.moe.expert_ffw_dim,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.mla.num_heads,
        num_key_value_heads=m.mla.num_heads,
        q_lora_rank=m.mla.q_lora_rank,
        kv_lora_rank=m.mla.kv_lora_rank,
        qk_nope_head_dim=m.mla.qk_nope_head_dim,
        qk_rope_head_dim=m.mla.qk_rope_head_dim,
        v_head_dim=m.mla.v_head_dim,
        index_topk=m.indexer.topk,
        index_head_dim=m.indexer.head_dim,
        index_n_heads=m.indexer.num_heads,
        n_routed_experts=m.moe.num_experts,
        num_experts_per_tok=m.moe.experts_per_token,
        n_shared_experts=m.moe.num_shared_experts,
        n_group=m.moe.num_groups,
        topk_group=m.moe.topk_groups,
        routed_scaling_factor=m.moe.routed_scaling_factor,
        first_k_dense_replace=m.moe.first_k_dense,
        max_position_embeddings=max(n, 4096),
        attn_implementation="eager",
    )


def run_hf(n: int) -> dict:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from jaxmoe.config import load_config  # noqa: PLC0415

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(_hf_config(load_config(CONFIG), n)).eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 512, (1, n))).long()
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids, logits_to_keep=1, use_cache=False).logits
        seconds = time.perf_counter() - t0
    assert torch.isfinite(logits).all()
    return {
        "benchmark": "long_context_hf_deepseek_v32",
        "tokens": n,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(n / seconds, 1),
        "peak_rss_gb": _peak_rss_gb(),
    }


def _subprocess(*flags, timeout=4 * 3600) -> dict:
    """Runs this script with ``flags`` in a fresh process: its JSON line, or ``{"failed": why}``."""
    try:
        out = subprocess.run(
            [sys.executable, __file__, *flags], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"failed": f"exit {out.returncode}: " + " | ".join(out.stderr.strip().splitlines()[-3:])}


def _commit() -> str | None:
    """The checked-out commit (``+`` if the tree differs from it), or None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


MEASURED = ("jaxmoe", "configs", "pyproject.toml")  # what the prefill's time depends on, in git


def _code() -> str | None:
    """A hash of what a measured time depends on: the committed ``MEASURED`` paths (their git
    object ids), the prefill this script builds and feeds, and the XLA and malloc settings. None
    outside a git checkout or with uncommitted changes under ``MEASURED``; commits that touch
    only other files (docs, tests) keep it, so their sweeps reuse earlier lengths."""
    try:
        ids = subprocess.run(
            ["git", "rev-parse", *(f"HEAD:{p}" for p in MEASURED)], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *MEASURED], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    if ids.returncode != 0 or dirty.stdout.strip():
        return None
    h = hashlib.sha256(ids.stdout.encode())
    for fn in (_prefill, _tokens):
        h.update(inspect.getsource(fn).encode())
    for k in ("XLA_FLAGS", *MALLOC):
        h.update(f"{k}={os.environ.get(k, '')}\n".encode())
    return h.hexdigest()[:12]


def _keep(results_file: pathlib.Path | None, r: dict) -> None:
    """Appends ``r`` to ``results_file`` (if any) as one JSON line."""
    if results_file is not None:
        with results_file.open("a") as f:
            f.write(json.dumps(r) + "\n")


def _measured(results_file: pathlib.Path | None) -> dict[int, dict]:
    """Lengths ``results_file`` already holds for this :func:`_code`."""
    code = _code()
    if results_file is None or not results_file.exists() or code is None:
        return {}
    done = {}
    for line in results_file.read_text().splitlines():
        r = json.loads(line) if line.startswith("{") else {}
        if r.get("benchmark") == "long_context" and "failed" not in r and r.get("code") == code:
            done[r["tokens"]] = r
    return done


def sweep(lengths, hf_timeout: float, results_file: pathlib.Path | None = None) -> None:
    """Each length in its own process; with ``results_file``, every line is appended there and a
    length already measured there for the same :func:`_code` is not run again (a long sweep can
    resume, also after commits that do not touch the measured code)."""
    done = _measured(results_file)

    def emit(r: dict) -> None:
        print(json.dumps(r), flush=True)
        _keep(results_file, r)

    results = []
    for n in lengths:
        if n in done:
            r = done[n]
            print(json.dumps(r), flush=True)
        else:
            r = _subprocess("--tokens", str(n))
            if "failed" in r:
                emit({"benchmark": "long_context", "tokens": n, **r})
                continue
            emit(r)
        results.append(r)
    x = np.log([r["tokens"] for r in results])
    y = np.log([r["seconds"] for r in results])
    exponent = float(np.polyfit(x, y, 1)[0]) if len(results) >= 2 else math.nan
    summary = {
        "benchmark": "long_context_sweep",
        "tokens": [r["tokens"] for r in results],
        "seconds": [r["seconds"] for r in results],
        "peak_rss_gb": [r["peak_rss_gb"] for r in results],
        "time_exponent": round(exponent, 3),
    }
    for n in HF_LENGTHS:  # HF builds [T, T] index scores and masks: find the longest it fits
        hf = _subprocess("--hf", "--tokens", str(n), timeout=hf_timeout)
        if "failed" in hf:
            emit({"benchmark": "long_context_hf_deepseek_v32", "tokens": n, **hf})
            continue
        emit(hf)
        ours = done.get(n) or _subprocess("--tokens", str(n))
        if "failed" in ours:
            emit({"benchmark": "long_context", "tokens": n, **ours})
            break
        if n not in done:
            emit(ours)
        summary.update(
            hf_tokens=n,
            hf_seconds=hf["seconds"],
            hf_peak_rss_gb=hf["peak_rss_gb"],
            jaxmoe_seconds_at_hf_tokens=ours["seconds"],
            speedup_vs_hf=round(hf["seconds"] / ours["seconds"], 2),
        )
        break
    emit(summary)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=65536, help="sequence length (a multiple of 8)")
    p.add_argument("--sweep", action="store_true", help="64K..1M, fitted exponent, HF deepseek_v32 ratio")
    p.add_argument("--max-tokens", type=int, default=SWEEP[-1], help="longest length of --sweep")
    p.add_argument("--memory", action="store_true", help="per-device memory analysis for context 1, 2, 4, 8")
    p.add_argument("--hf", action="store_true", help="time HF transformers deepseek_v32 instead")
    p.add_argument("--hf-timeout", type=float, default=900, help="seconds allowed per HF attempt in --sweep")
    p.add_argument(
        "--results",
        type=pathlib.Path,
        default=None,
        help="append every line to this JSONL file; --sweep skips lengths it holds for the same measured code",
    )
    args = p.parse_args()
    if args.sweep:
        sweep([n for n in SWEEP if n <= args.max_tokens], args.hf_timeout, args.results)
    elif args.memory:
        print(json.dumps(run_memory(args.tokens)))
    elif args.hf:
        print(json.dumps(run_hf(args.tokens)))
    else:
        if args.tokens % 8:
            p.error(f"--tokens must be a multiple of the 8 context shards, got {args.tokens}")
        r = run_jaxmoe(args.tokens)
        print(json.dumps(r))
        _keep(args.results, r)  # a length run alone, kept for a later --sweep to reuse


if __name__ == "__main__":
    main()
