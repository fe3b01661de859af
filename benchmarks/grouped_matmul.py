"""Grouped matmul on this machine: ``"blocked"`` vs ``jax.lax.ragged_dot`` vs an equal-work batched matmul.

    python benchmarks/grouped_matmul.py [--m 16384] [--d 256] [--f 128] [--e 16] [--block N] [--repeats 10]

``x[M, D] @ w[E, D, F]`` with E equal groups of M/E rows, fp32, jitted; the dense baseline is
``einsum('EMD,EDF->EMF')`` on ``x`` reshaped to ``[E, M/E, D]``, the same flops with no routing.
Times are the best of ``--repeats`` runs taken in interleaved rounds (so machine noise hits all
three alike), forward alone and forward + reverse-mode grads wrt ``x`` and ``w``. Prints one
JSON line with the times and the ratios to the dense baseline.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.moe.grouped import default_block, grouped_matmul


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--f", type=int, default=128)
    p.add_argument("--e", type=int, default=16)
    p.add_argument("--block", type=int, default=None, help="rows per block (default: default_block(M, E))")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--ragged-repeats", type=int, default=3, help="ragged_dot is slow on CPU")
    args = p.parse_args()
    M, D, F, E = args.m, args.d, args.f, args.e
    if M % E:
        raise ValueError(f"--m={M} must be a multiple of --e={E} for the equal-work dense baseline")
    block = args.block or default_block(M, E)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), jnp.float32)
    r = jnp.asarray(rng.normal(size=(M, F)), jnp.float32)
    group_sizes = jnp.full((E,), M // E, jnp.int32)

    fns = {
        "dense": lambda x, w: jnp.einsum("EMD,EDF->EMF", x.reshape(E, M // E, D), w).reshape(M, F),
        "blocked": lambda x, w: grouped_matmul(x, w, group_sizes, impl="blocked", block=block),
        "ragged": lambda x, w: grouped_matmul(x, w, group_sizes, impl="ragged"),
    }
    fwd = {k: jax.jit(f) for k, f in fns.items()}
    grad = {k: jax.jit(jax.grad(lambda x, w, f=f: jnp.sum(f(x, w) * r), argnums=(0, 1))) for k, f in fns.items()}
    want = np.asarray(fwd["dense"](x, w))
    max_diff = {k: float(np.abs(np.asarray(f(x, w)) - want).max()) for k, f in fwd.items()}  # + compile
    for g in grad.values():
        jax.block_until_ready(g(x, w))

    best = {f"{k}_{kind}_s": float("inf") for k in fns for kind in ("fwd", "fwd_bwd")}
    for i in range(args.repeats):
        for k in fns:
            if k == "ragged" and i >= args.ragged_repeats:
                continue
            for kind, f in (("fwd", fwd[k]), ("fwd_bwd", grad[k])):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, w))
                best[f"{k}_{kind}_s"] = min(best[f"{k}_{kind}_s"], time.perf_counter() - t0)

    out = {"benchmark": "grouped_matmul", "M": M, "D": D, "F": F, "E": E, "block": block}
    out |= {k: round(v, 5) for k, v in best.items()}
    for kind in ("fwd", "fwd_bwd"):
        for k in ("blocked", "ragged"):
            out[f"{k}_over_dense_{kind}"] = round(best[f"{k}_{kind}_s"] / best[f"dense_{kind}_s"], 2)
    out["ragged_over_blocked_fwd"] = round(best["ragged_fwd_s"] / best["blocked_fwd_s"], 1)
    out["max_abs_diff_vs_dense"] = {k: max_diff[k] for k in ("blocked", "ragged")}
    out["backend"] = jax.default_backend()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
