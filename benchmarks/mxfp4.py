"""MXFP4 on this machine: quantize throughput vs memcpy, checkpoint size, quantization error, logit drift.

    python benchmarks/mxfp4.py [--elements 33554432] [--repeats 5]

Prints one JSON line:

- ``quantize_gbps``: float32 bytes in per second through the host-side ``mxfp4.quantize`` (the
  NaN/Inf check included) and ``quantize_kernel_gbps`` through the jitted kernel alone;
  ``memcpy_gbps``: a numpy copy of the same array (bytes read per second), measured in the same
  run; their ratios. ``xla_elementwise_gbps``: a jitted ``x * 2`` (fresh output each call) for
  scale. Best of ``--repeats``.
- ``checkpoint_ratio_*``: bytes of the model state with MXFP4 routed experts (other weights
  bf16) over the all-bf16 state, for the tiny config (array bytes and Orbax bytes on disk) and
  the target config (array bytes from the abstract model); ``expert_ratio``: the routed experts
  alone, which is the format's 4.25 / 16 = 0.2656.
- ``gaussian_rel_rms_error``: ``||dequantize(quantize(x)) - x|| / ||x||`` for N(0, 1) values.
- ``logit_*``: the tiny model (fp32) against the same model with its routed experts quantized:
  max abs difference, and RMS difference over RMS of the fp32 logits, on random tokens.
"""

import argparse
import dataclasses
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.checkpoint.io import save_model
from jaxmoe.config import Config, load_config
from jaxmoe.model import abstract_model, create_model
from jaxmoe.quant import ROUTED_EXPERTS, checkpoint_bytes, mxfp4, quantize_state

ROOT = pathlib.Path(__file__).parent.parent


def _best(f, repeats):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f())
        best = min(best, time.perf_counter() - t)
    return best


def _bf16_bytes(state) -> int:
    return int(sum(np.prod(x.shape) * (1 if x.dtype == jnp.uint8 else 2) for x in jax.tree.leaves(state)))


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _model_bytes(cfg):
    """(all-bf16 array bytes, MXFP4-experts + bf16 array bytes, bf16 routed-expert bytes, MXFP4 routed-expert bytes)."""
    f_state = nnx.to_pure_dict(nnx.state(abstract_model(cfg)))
    q_state = nnx.to_pure_dict(nnx.state(abstract_model(dataclasses.replace(cfg, mxfp4_weights=ROUTED_EXPERTS))))

    def experts(state):
        out = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            if any(getattr(k, "key", None) in ROUTED_EXPERTS for k in path):
                out.append(leaf)
        return out

    return _bf16_bytes(f_state), _bf16_bytes(q_state), _bf16_bytes(experts(f_state)), _bf16_bytes(experts(q_state))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=32 * 2**20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n = args.elements - args.elements % 4096

    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(n // 4096, 4096)).astype(np.float32)
    x = jnp.asarray(x_np)
    nbytes = x_np.nbytes
    dst = np.empty_like(x_np)
    memcpy_s = _best(lambda: np.copyto(dst, x_np), args.repeats)
    quantize_s = _best(lambda: mxfp4.quantize(x), args.repeats)
    kernel_s = _best(lambda: mxfp4.quantize_jitted(x), args.repeats)
    scale = jax.jit(lambda x: x * 2.0)  # the cheapest jitted pass over the array: XLA's own floor
    scale_s = _best(lambda: scale(x), args.repeats)
    blocks, scales = mxfp4.quantize(x)
    y = np.asarray(mxfp4.dequantize(blocks, scales))
    rel_rms = float(np.sqrt(np.mean((y - x_np) ** 2) / np.mean(x_np**2)))

    tiny = load_config(ROOT / "configs/tiny.py")
    # expert_ffw_dim 64 so w_down's contracting dim (F/32 = 2 blocks) splits over the tiny mesh's tensor=2.
    fcfg = dataclasses.replace(tiny.model, moe=dataclasses.replace(tiny.model.moe, expert_ffw_dim=64))
    qcfg = dataclasses.replace(fcfg, mxfp4_weights=ROUTED_EXPERTS)
    tiny_f, tiny_q, tiny_ef, tiny_eq = _model_bytes(fcfg)
    target = load_config(ROOT / "configs/target.py").model
    target_f, target_q, target_ef, target_eq = _model_bytes(target)

    fmodel = create_model(fcfg, seed=0)
    f_state = nnx.to_pure_dict(nnx.state(fmodel))
    graphdef, state = nnx.split(abstract_model(qcfg))
    nnx.replace_by_pure_dict(state, quantize_state(f_state, qcfg))
    qmodel = nnx.merge(graphdef, state)
    tokens = np.random.default_rng(1).integers(0, fcfg.vocab_size, (4, 64), dtype=np.int32)
    forward = jax.jit(lambda model, tokens: model(tokens))
    lf, lq = np.asarray(forward(fmodel, tokens)), np.asarray(forward(qmodel, tokens))

    with tempfile.TemporaryDirectory() as tmp:
        bf16 = dataclasses.replace(fcfg, param_dtype="bfloat16")
        bf16_q = dataclasses.replace(bf16, mxfp4_weights=ROUTED_EXPERTS)
        to_bf16 = lambda s: jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, s)
        for name, cfg, params in (
            ("bf16", bf16, to_bf16(f_state)),
            ("mxfp4", bf16_q, to_bf16(quantize_state(f_state, qcfg))),
        ):
            graphdef, state = nnx.split(abstract_model(cfg))
            nnx.replace_by_pure_dict(state, params)
            save_model(nnx.merge(graphdef, state), Config(model=cfg), pathlib.Path(tmp) / name)
        disk_bf16 = _dir_bytes(pathlib.Path(tmp) / "bf16" / "params")
        disk_q = _dir_bytes(pathlib.Path(tmp) / "mxfp4" / "params")

    out = {
        "elements": n,
        "quantize_gbps": nbytes / quantize_s / 1e9,
        "quantize_kernel_gbps": nbytes / kernel_s / 1e9,
        "memcpy_gbps": nbytes / memcpy_s / 1e9,
        "xla_elementwise_gbps": nbytes / scale_s / 1e9,
        "quantize_over_memcpy": memcpy_s / quantize_s,
        "quantize_kernel_over_memcpy": memcpy_s / kernel_s,
        "checkpoint_ratio_tiny": tiny_q / tiny_f,
        "checkpoint_ratio_tiny_on_disk": disk_q / disk_bf16,
        "checkpoint_ratio_target": target_q / target_f,
        "expert_ratio": target_eq / target_ef,
        "expert_ratio_tiny": tiny_eq / tiny_ef,
        "format_limit": 4.25 / 16,
        "gaussian_rel_rms_error": rel_rms,
        "logit_max_abs_drift": float(np.abs(lq - lf).max()),
        "logit_rel_rms_drift": float(np.sqrt(np.mean((lq - lf) ** 2) / np.mean(lf**2))),
        "logit_rms": float(np.sqrt(np.mean(lf**2))),
        "tiny_state_bytes_fp32": checkpoint_bytes(f_state),
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
