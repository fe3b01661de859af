"""Train-step MFU against this machine's f32 matmul peak, and train-step tokens/s vs HF transformers.

    python benchmarks/train_mfu.py                  # one CPU device using every core (one JSON line)
    python benchmarks/train_mfu.py --devices 8      # XLA's 8 fake CPU devices, mesh data=8
    python benchmarks/train_mfu.py --devices 8 --mesh data=2,fsdp=4
    python benchmarks/train_mfu.py --quick          # tiny dims, two timed steps: checks the script runs

The weights: a random ``transformers.DeepseekV3ForCausalLM`` (every layer ``mla``, MoE with a
dense first layer, sigmoid router with group-limited top-k and a random correction bias), the
architecture of ``benchmarks/forward_vs_hf.py`` with every width scaled to ``--d-model`` (its
``SHAPE`` is ``--d-model 256``), saved with ``save_pretrained`` and imported with jaxmoe's HF
importer. Both sides then train from the same weights on the same batches of random tokens, fp32:

- jaxmoe: the jit-compiled step of :class:`jaxmoe.train.step.Trainer` (AdamW with global-norm
  clipping, the aux-loss-free router-bias update) sharded over the mesh; compiled ahead of time,
  so compilation is excluded (``jaxmoe_compile_s``).
- HF: forward, mean next-token cross-entropy, backward, ``clip_grad_norm_`` and
  ``torch.optim.AdamW`` (decay on matrices only, as jaxmoe), torch on CPU with
  ``torch.set_num_threads(os.cpu_count())``, HF's default experts implementation, sdpa attention.

The first step's loss of both (before any update) must agree: ``first_loss_abs_diff``. After
``--warmup`` untimed rounds, ``--steps`` rounds each time one jaxmoe step then one HF step
(interleaved, so load from other processes hits both alike); throughputs use the median step.

MFU is ``model_flops_per_token * jaxmoe_tokens_per_s / peak_flops``
(:func:`jaxmoe.train.metrics.model_flops_per_token`: 6 x activated matmul parameters + causal
attention). ``peak_flops`` is this machine's f32 matmul peak, measured in this run before and
after the timed steps with :func:`jaxmoe.train.metrics.measure_peak_flops` (best of both
measurements, of a few sizes, of all devices at once and of one device alone, which on XLA:CPU
also uses every core). ``mfu_train_loop`` is the figure ``jaxmoe train`` logs: against the
per-device peak measured with all devices busy at once, times the device count.
``xla_flops_per_token`` is XLA's cost analysis of the compiled step, for comparison only: it
counts a while loop's body once, so the MoE's grouped-matmul tile loops are undercounted.

On a machine other processes share, wall-clock figures move with their load (``loadavg_1_5_15min``;
``*_cpu_share`` is the fraction of all cores the process got during the steps). ``mfu_cpu_time``
replaces both times by this process's CPU time: the step's model FLOPs per CPU-second over a
matmul's FLOPs per CPU-second (``peak_flops_per_cpu_second``); it is what the MFU would be with the
cores to itself (spin-waiting threads count as busy), and ``ratio_cpu_time`` the same for the ratio.

Which device count: XLA's fake CPU devices share the machine's cores. The default, one device,
runs one program whose matmuls XLA:CPU spreads over every core, as torch does, so it measures how
well the step uses this machine. ``--devices 8`` runs the sharded job of ``jaxmoe train`` (eight
programs at once on the same cores, each with 1/8 of the batch); on a 2-core machine it costs
2.5-3x the CPU time per step, mostly emulation overhead that real devices do not pay: with
``data=8`` every device runs the whole AdamW update on its replica (8x the optimizer work) and
all-reduces the gradients by copying, and each device's matmuls are 8 times smaller.

Measured on a shared 2-core Xeon (AVX-512; load average 4-9), default dims: one device
``mfu_cpu_time`` 0.29 (``mfu`` 0.15), ``ratio`` 2.4 over HF; ``--devices 8`` (data=8 or
data=2,fsdp=4) ``mfu_cpu_time`` 0.10-0.12, ``ratio`` 0.76-0.89. ``--d-model 1024``: 0.30, 1.8.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

from jaxmoe.rules import MESH_AXES  # plain data: imports no jax, so the device count can still be set

PRESETS = {
    # d_model, layers, vocab, seq, batch, timed steps, warm-up rounds
    "default": dict(d_model=512, layers=4, vocab=4096, seq=256, batch=8, steps=5, warmup=1),
    "quick": dict(d_model=64, layers=2, vocab=512, seq=32, batch=8, steps=2, warmup=0),
}


def hf_shape(d_model: int, layers: int, vocab: int, seq: int) -> dict:
    """DeepseekV3Config kwargs: forward_vs_hf's architecture with every width scaled to ``d_model``."""
    return dict(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=3 * d_model,
        moe_intermediate_size=d_model // 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=3 * d_model // 8,
        kv_lora_rank=d_model // 4,
        qk_rope_head_dim=d_model // 16,
        qk_nope_head_dim=d_model // 8,
        v_head_dim=d_model // 8,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=max(seq, 4096),
        tie_word_embeddings=False,
    )


def parse_mesh(text: str, devices: int) -> dict:
    """``"data=2,expert=4"`` -> ``{"data": 2, "expert": 4}``; the sizes must multiply to ``devices``."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+)=(\d+)", part)
        if not m or m.group(1) not in MESH_AXES or int(m.group(2)) < 1:
            raise ValueError(f"--mesh: {part!r} is not AXIS=SIZE with AXIS one of {MESH_AXES} and SIZE >= 1")
        sizes[m.group(1)] = int(m.group(2))
    total = 1
    for v in sizes.values():
        total *= v
    if total != devices:
        raise ValueError(f"--mesh {text!r} has {total} devices, --devices is {devices}: the sizes must multiply to it")
    return sizes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny dims and 2 steps (a smoke run for tests)")
    p.add_argument(
        "--devices", type=int, default=1, help="XLA CPU devices (more than 1: fake devices sharing the cores)"
    )
    p.add_argument("--mesh", default=None, help="AXIS=SIZE,... over --devices (default: data=<devices>)")
    p.add_argument("--dispatch", default="dense", choices=("dense", "dropless", "capacity"), help="model.moe.dispatch")
    p.add_argument("--d-model", type=int, default=None, help="hidden size, a multiple of 16 (default 512)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers, the first dense (default 4)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 4096)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8)")
    p.add_argument("--steps", type=int, default=None, help="timed steps of each (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds after the first step (default 1)")
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "default"]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("devices", "d_model", "layers", "vocab", "seq", "batch", "steps"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.d_model % 16:
        p.error(f"--d-model must be a multiple of 16 (head and rope dims are fractions of it), got {args.d_model}")
    if args.layers < 2:
        p.error(f"--layers must be >= 2 (one dense layer, then MoE layers), got {args.layers}")
    try:
        args.mesh_sizes = parse_mesh(args.mesh or f"data={args.devices}", args.devices)
    except ValueError as e:
        p.error(str(e))
    return args


def _set_devices(n: int) -> None:
    """XLA's CPU device count, set before jax initialises (replacing any count already in XLA_FLAGS)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _flops_per_cpu_second(device, n: int, repeats: int = 3) -> float:
    """FLOPs of a jitted f32 ``[n, n] @ [n, n]`` on ``device`` per second of this process's CPU time.

    Unlike wall time, CPU time does not count the time other processes hold the cores, so on a
    shared machine this is the steadier figure of what a core does per second of its time.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        matmul(a, a).block_until_ready()
        best = min(best, time.process_time() - start)
    return 2.0 * n**3 / best


def machine_peak(measure_peak_flops, devices, sizes) -> dict:
    """This machine's f32 matmul peak, best over ``sizes`` (matrix sides).

    Returns ``{"machine": FLOP/s, "per_device_all_busy": FLOP/s, "per_cpu_second": FLOP/CPU-s}``:
    the machine figure is the better of all devices at once and one device alone (which on
    XLA:CPU spreads each matmul over every core).
    """
    all_busy = max(measure_peak_flops(devices, n=n, repeats=3) for n in sizes)
    alone = max(measure_peak_flops(devices[:1], n=n, repeats=3) for n in sizes)
    per_cpu = max(_flops_per_cpu_second(devices[0], n) for n in sizes)
    return {"machine": max(all_busy * len(devices), alone), "per_device_all_busy": all_busy, "per_cpu_second": per_cpu}


def build_hf(args):
    """A random DeepseekV3ForCausalLM in train mode, its config dict and the AdamW optimizer over it."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**hf_shape(args.d_model, args.layers, args.vocab, args.seq))
    config._attn_implementation = "sdpa"
    hf = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, t in hf.named_buffers():
            if "e_score_correction_bias" in name:  # not all zero, so the selection bias matters
                t.copy_(0.05 * torch.randn(t.shape))
    hf.train()
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    return hf, decay, no_decay


def main(argv=None) -> dict:
    args = parse_args(argv)
    _set_devices(args.devices)

    import dataclasses  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from jaxmoe.checkpoint.hf_import import SafetensorsFolder, config_from_hf, load_weights  # noqa: PLC0415
    from jaxmoe.config import MeshConfig, OptimConfig, TrainConfig, validate  # noqa: PLC0415
    from jaxmoe.model import abstract_model  # noqa: PLC0415
    from jaxmoe.moe.router import RouterBias  # noqa: PLC0415
    from jaxmoe.sharding import make_mesh  # noqa: PLC0415
    from jaxmoe.train.metrics import measure_peak_flops, model_flops_per_token  # noqa: PLC0415
    from jaxmoe.train.step import Trainer, TrainState  # noqa: PLC0415

    if jax.device_count() != args.devices:
        raise SystemExit(f"--devices {args.devices}: jax sees {jax.device_count()} devices (set before jax starts?)")
    torch.set_num_threads(os.cpu_count())
    load_start = os.getloadavg()
    peak_sizes = (256,) if args.quick else (512, 1024)
    peak_before = machine_peak(measure_peak_flops, jax.devices(), peak_sizes)

    # --- the same weights on both sides --------------------------------------------------------
    hf, decay, no_decay = build_hf(args)
    optim = OptimConfig()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        cfg = config_from_hf(json.loads((pathlib.Path(d) / "config.json").read_text()))
        # Loaded into the abstract model: a randomly initialised one would compile a program per shape.
        model = abstract_model(cfg.model)
        tensors = SafetensorsFolder(pathlib.Path(d))
        load_weights(model, tensors, "deepseek_v3")
    unused = set(tensors) - tensors.used
    if unused:
        raise RuntimeError(f"the import left {len(unused)} HF tensors unused, e.g. {sorted(unused)[:3]}")
    hf_opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=optim.weight_decay), dict(params=no_decay, weight_decay=0.0)],
        lr=optim.learning_rate,
        betas=(optim.b1, optim.b2),
        eps=optim.eps,
    )
    total_steps = 1 + args.warmup + args.steps
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, dispatch=args.dispatch)),
        mesh=MeshConfig(**args.mesh_sizes),
        train=TrainConfig(steps=total_steps, batch_size=args.batch, seq_len=args.seq, optim=optim),
    )
    validate(cfg)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, args.vocab, (args.batch, args.seq + 1), dtype=np.int32) for _ in range(total_steps)]

    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        _, params, bias = nnx.split(model, nnx.Param, RouterBias)
        unset = [x for x in jax.tree.leaves((params, bias)) if isinstance(x, jax.ShapeDtypeStruct)]
        if unset:
            raise RuntimeError(f"the HF import left {len(unset)} model arrays unset, e.g. of shape {unset[0].shape}")
        # Trainer.init_state only makes fresh weights: place the imported ones by its shardings.
        params = jax.device_put(nnx.to_pure_dict(params), trainer.state_shardings.params)
        bias = jax.device_put(nnx.to_pure_dict(bias), trainer.state_shardings.router_bias)
        opt_state = jax.jit(trainer.tx.init, out_shardings=trainer.state_shardings.opt_state)(params)
        state = TrainState(params, bias, opt_state, None)
        inputs, targets = trainer.batch(batches[0])
        start = time.perf_counter()
        step = trainer.compile_step("main", state, inputs, targets)
        compile_s = time.perf_counter() - start
        cost = step.cost_analysis()
        xla_flops = float(cost.get("flops", 0.0)) if isinstance(cost, dict) else float("nan")

        def jax_step(state, tokens):
            state, metrics = step(state, *trainer.batch(tokens))
            jax.block_until_ready(state)
            return state, float(metrics["loss"])

        def hf_step(tokens):
            t = torch.from_numpy(tokens).long()
            hf_opt.zero_grad(set_to_none=True)
            logits = hf(input_ids=t[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab).float(), t[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), optim.grad_clip)
            hf_opt.step()
            return loss.item()

        jax_times, hf_times, jax_cpu, hf_cpu = [], [], [], []
        for i, tokens in enumerate(batches):
            t0, c0 = time.perf_counter(), time.process_time()
            state, jax_loss = jax_step(state, tokens)
            t1, c1 = time.perf_counter(), time.process_time()
            hf_loss = hf_step(tokens)
            t2, c2 = time.perf_counter(), time.process_time()
            if i == 0:
                first_loss = (jax_loss, hf_loss)
            elif i > args.warmup:
                jax_times.append(t1 - t0)
                hf_times.append(t2 - t1)
                jax_cpu.append(c1 - c0)
                hf_cpu.append(c2 - c1)

    peak_after = machine_peak(measure_peak_flops, jax.devices(), peak_sizes)
    peak, per_device, per_cpu_s = (
        max(peak_before[k], peak_after[k]) for k in ("machine", "per_device_all_busy", "per_cpu_second")
    )
    tokens_per_step = args.batch * args.seq
    jax_s, hf_s = statistics.median(jax_times), statistics.median(hf_times)
    flops = model_flops_per_token(cfg, "main")
    jax_tps = tokens_per_step / jax_s
    cores = os.cpu_count()
    jax_cpu_s, hf_cpu_s = statistics.median(jax_cpu), statistics.median(hf_cpu)
    result = {
        "benchmark": "train_mfu",
        "tokens_per_step": tokens_per_step,
        "jaxmoe_tokens_per_s": round(jax_tps, 1),
        "hf_tokens_per_s": round(tokens_per_step / hf_s, 1),
        "ratio": round(hf_s / jax_s, 3),
        "model_flops_per_token": flops,
        "peak_flops": peak,
        "mfu": round(flops * jax_tps / peak, 4),
        "mfu_train_loop": round(flops * jax_tps / (per_device * args.devices), 4),
        "peak_flops_per_device_all_busy": per_device,
        "peak_flops_per_cpu_second": per_cpu_s,
        "mfu_cpu_time": round(flops * tokens_per_step / (jax_cpu_s * per_cpu_s), 4),
        "jaxmoe_cpu_share": round(jax_cpu_s / (jax_s * cores), 3),
        "hf_cpu_share": round(hf_cpu_s / (hf_s * cores), 3),
        "ratio_cpu_time": round(hf_cpu_s / jax_cpu_s, 3),
        "xla_flops_per_token": xla_flops * args.devices / tokens_per_step,
        "first_loss_abs_diff": abs(first_loss[0] - first_loss[1]),
        "first_loss": first_loss[0],
        "jaxmoe_step_s": [round(t, 3) for t in jax_times],
        "hf_step_s": [round(t, 3) for t in hf_times],
        "jaxmoe_compile_s": round(compile_s, 1),
        "devices": f"{args.devices} CPU device(s) on {cores} cores",
        "mesh": args.mesh_sizes,
        "dispatch": args.dispatch,
        "model": dict(d_model=args.d_model, layers=args.layers, vocab=args.vocab, seq=args.seq, batch=args.batch),
        "hf_experts_implementation": hf.config._experts_implementation,
        "hf_attn_implementation": hf.config._attn_implementation,
        "torch_threads": torch.get_num_threads(),
        "loadavg_1_5_15min": {
            "start": [round(x, 2) for x in load_start],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
