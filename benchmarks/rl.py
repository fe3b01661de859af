"""GRPO step throughput: rollout tokens/s through the engine, train tokens/s, and the share of
step time spent in rollouts.

    python benchmarks/rl.py --init runs/tiny [--config configs/tiny.py:rl] [--steps 4] [--config.KEY=VALUE ...]

Runs ``--steps`` GRPO steps of the config from the ``--init`` run (``bash launch/local.sh`` makes
``runs/tiny``) in a temporary workdir, and averages the steps after the first (which compiles):

- ``rollout_tokens_per_s``: completion tokens generated per second of rollout time;
- ``train_tokens_per_s``: positions (prompt + completion, padded) through the update per second;
- ``rollout_share``: rollout time over rollout + update time.

Prints one JSON line, and nothing else on stdout.
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init", default="runs/tiny", help="the training workdir to start from")
    p.add_argument("--config", default="configs/tiny.py:rl")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps (>= 2: the first compiles and is not counted)")
    from jaxmoe.train.overrides import split_overrides  # noqa: PLC0415

    extra, argv = split_overrides(list(argv) if argv is not None else __import__("sys").argv[1:])
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first step compiles), got {args.steps}")
    from jaxmoe.rl.config import load_rl_config  # noqa: PLC0415
    from jaxmoe.rl.loop import train_rl  # noqa: PLC0415

    overrides = [*extra, ("rl.steps", str(args.steps)), ("rl.eval_every", "0"), ("rl.checkpoint_every", "0")]
    cfg, rl = load_rl_config(args.config, overrides)
    with tempfile.TemporaryDirectory() as workdir:
        train_rl(cfg, rl, workdir, args.init, progress=False, stdout=False)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, f) if "loss" in r][1:]
    rollout_s = sum(r["rollout_s"] for r in records)
    train_s = sum(r["train_s"] for r in records)
    out = {
        "steps_measured": len(records),
        "prompts_x_group": rl.prompts_per_step * rl.group_size,
        "rollout_tokens_per_s": round(sum(r["rollout_tokens"] for r in records) / rollout_s, 1),
        "train_tokens_per_s": round(sum(r["train_tokens"] for r in records) * rl.updates_per_batch / train_s, 1),
        "rollout_share": round(rollout_s / (rollout_s + train_s), 4),
        "step_s": round((rollout_s + train_s) / len(records), 3),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
