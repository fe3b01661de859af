"""The one small training run the tests share (tests/conftest.py makes it once per session): its
config overrides, also as ``--config.KEY=VALUE`` flags for subprocess runs, and its record.

Runs of the same program in one process compile once (the train step is a module-level function
jitted with static config), so the tests that train the same config again pay no compilation."""

import dataclasses
import json
import os
import pathlib
import socket

ROOT = pathlib.Path(__file__).parents[1]
TINY_TRAIN = f"{ROOT / 'configs/tiny.py'}:train"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a coordinator's or a server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator_flags(num_processes: int = 2) -> list[str]:
    """The CLI flags of a local multi-process run on a free port. CI's two cores also run the other
    test worker, whose compiles can starve a process's heartbeats past JAX's 100 s (seen once):
    the coordinator waits longer before it calls a process dead."""
    return ["--coordinator_address", f"127.0.0.1:{free_port()}", "--num_processes", str(num_processes),
            "--heartbeat_timeout", "900"]  # fmt: skip


def process_env(devices: int) -> dict[str, str]:
    """The environment of one process of a multi-process CPU run: ``devices`` fake devices, fp32 matmuls."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    }
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


# The tiny model cut to one DSA + MoE layer (DSA's dense warm-up is MLA), trained for 6 steps on
# the config's mesh data 2 x expert 2 x context 2: 2 warm-up steps, then 4 sparse ones (top-8 of 32).
OVERRIDES = (
    ("model.num_layers", "1"),
    ("model.layer_kinds", "('dsa',)"),
    ("model.moe.first_k_dense", "0"),
    ("model.indexer.topk", "8"),
    ("steps", "6"),
    ("batch_size", "8"),
    ("seq_len", "32"),
    ("dsa.warmup_steps", "2"),
    ("log_every", "1"),
    ("eval_every", "3"),
    ("eval_batches", "2"),
    ("checkpoint_every", "3"),
    ("data.max_bytes", "300000"),
    ("data.heldout_fraction", "0.1"),
    ("peak_flops", "1e10"),
)


@dataclasses.dataclass
class Run:
    workdir: pathlib.Path
    summary: dict

    def records(self) -> list[dict]:
        return [json.loads(line) for line in (self.workdir / "metrics.jsonl").read_text().splitlines()]

    def values(self, key: str = "loss") -> dict[int, float]:
        """``{step: record[key]}`` over the records that have ``key``."""
        return {r["step"]: r[key] for r in self.records() if key in r}
