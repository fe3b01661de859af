"""Training metrics: model FLOPs per token, the machine's matmul peak, expert-load summaries, and
the writer that sends each record to stdout, ``metrics.jsonl`` and TensorBoard.

MFU is ``flops_per_token * tokens_per_s / (peak_flops_per_device * devices)``. Model FLOPs per
token are the usual ``6 N`` over the activated matmul parameters ``N`` (the embedding lookup is
no matmul; routed experts count ``K / E`` of their weights) plus the attention terms, 3x the
forward for forward + backward:

- ``mla`` (and DSA during the dense warm-up): ``2 N_h (H_qk + H_v)`` per visible key, ``(T+1)/2``
  keys per query on average (causal);
- ``dsa``: absorbed attention to ``min(t+1, topk)`` keys, ``2 N_h (2C + R)`` each, plus the
  indexer's scores over all visible keys, ``2 NI HI`` each (forward only: selection has no gradient);
- ``kda``: three ``H_k x H_v`` state products per head per token (read, rank-1 update, output).

The warm-up stage runs no backward through the main model, so its figure counts the forward
(``2 N`` + attention) and the indexer's KL (its scores forward and backward).
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.model import abstract_model
from jaxmoe.moe import MoE
from jaxmoe.paths import Path, is_uri, resolve
from jaxmoe.train.tensorboard import EventLog

# --------------------------------------------------------------------------------------------
# FLOPs


def _matmul_params(cfg: Config) -> float:
    """Activated parameters that enter a matmul, per token."""
    model = abstract_model(cfg.model)
    m = cfg.model
    total = 0.0
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = v.get_value().shape
        if len(shape) < 2 or (path == ("embed",) and not m.tie_embeddings):
            continue
        total += math.prod(shape)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, MoE):
            routed = sum(math.prod(w.get_value().shape) for w in (module.w_gate, module.w_up, module.w_down))
            total -= routed * (1 - m.moe.experts_per_token / m.moe.num_experts)
    return total


def model_flops_per_token(cfg: Config, stage: str = "main") -> float:
    """Model FLOPs of one training token of ``cfg`` at ``cfg.train.seq_len`` (see the module doc)."""
    m, T = cfg.model, cfg.train.seq_len
    causal = (T + 1) / 2
    a, ix = m.mla, m.indexer
    dense_attn = 2 * a.num_heads * (a.qk_head_dim + a.v_head_dim) * causal
    topk = min(ix.topk, T)
    sparse_keys = (topk * (topk + 1) / 2 + (T - topk) * topk) / T  # mean over t of min(t+1, topk)
    sparse_attn = 2 * a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim) * sparse_keys
    index_scores = 2 * ix.num_heads * ix.head_dim * causal
    kda = 3 * 2 * m.kda.num_heads * m.kda.head_dim * m.kda.head_dim
    warmup = stage == "warmup"
    mult = 1 if warmup else 3
    flops = (2 if warmup else 6) * _matmul_params(cfg)
    for kind in m.layer_kinds:
        if kind == "mla":
            flops += mult * dense_attn
        elif kind == "dsa":
            flops += mult * dense_attn + 3 * index_scores if warmup else 3 * sparse_attn + index_scores
        else:
            flops += mult * kda
    return float(flops)


def measure_peak_flops(devices=None, n: int | None = None, repeats: int = 3) -> float:
    """FLOP/s per device of a jitted f32 matmul run on all ``devices`` (default: this process's) at once.

    Devices that share hardware (XLA's fake CPU devices) share it here too, so the figure is what
    each gets when all work, the same condition as the train step.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if n is None:
        n = 512 if devices[0].platform == "cpu" else 4096
    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    a = jax.jit(lambda: jnp.ones((len(devices), n, n), jnp.float32), out_shardings=sharding)()
    matmul = jax.jit(
        lambda x, y: jnp.einsum("bij,bjk->bik", x, y, precision=jax.lax.Precision.HIGHEST), out_shardings=sharding
    )
    matmul(a, a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


# --------------------------------------------------------------------------------------------
# Expert load


def load_summary(expert_load: Mapping[Any, Any], drop_fraction: Mapping[Any, Any]) -> dict:
    """Per MoE layer load ``[E]`` and drop fraction -> the logged fields (layer keys as strings).

    ``max_mean_load`` is ``max_e load / mean_e load`` (1 is perfectly even); ``*_avg`` averages
    over layers.
    """
    if not expert_load:
        return {}
    loads = {str(k): np.asarray(v, np.int64) for k, v in sorted(expert_load.items())}
    ratio = {k: float(v.max() / max(v.mean(), 1e-12)) for k, v in loads.items()}
    drops = [float(v) for v in drop_fraction.values()]
    return {
        "expert_load": {k: v.tolist() for k, v in loads.items()},
        "max_mean_load": ratio,
        "max_mean_load_avg": float(np.mean(list(ratio.values()))),
        "drop_fraction": float(np.mean(drops)) if drops else 0.0,
    }


# --------------------------------------------------------------------------------------------
# Output


def _flat_scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in record.items():
        tag = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_scalars(v, f"{tag}/"))
        elif isinstance(v, list | tuple):
            out.update(_flat_scalars({str(i): x for i, x in enumerate(v)}, f"{tag}/"))
        elif isinstance(v, bool | int | float | np.number) and k != "step":
            out[tag] = float(v)
    return out


def _step_of(line: str) -> float:
    """The step of a ``metrics.jsonl`` line; a line cut short by a kill counts as after every step."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


class MetricsWriter:
    """Writes each record as a JSON line to stdout and ``workdir/metrics.jsonl``, scalars to TensorBoard.

    Args:
        workdir: the run directory (``metrics.jsonl`` and ``tensorboard/`` go there); a bucket
            (``gs://...``) too: objects cannot be appended to, so both are written to a local
            directory and copied up whole by :meth:`sync` (at every checkpoint and at the end).
        resume_step: records of later steps already in ``metrics.jsonl`` (from a run that died
            after its last checkpoint) are dropped, so the file holds each step once; TensorBoard
            purges their events (see :mod:`jaxmoe.train.tensorboard`).
        stdout: also print each record.
        enabled: False on processes other than 0: nothing is written.
    """

    def __init__(self, workdir: str | Path, *, resume_step: int = 0, stdout: bool = True, enabled=True):
        self.enabled, self.stdout = enabled, stdout
        if not enabled:
            return
        self.workdir = resolve(workdir)
        self._staging = pathlib.Path(tempfile.mkdtemp(prefix="jaxmoe_metrics_")) if is_uri(self.workdir) else None
        local = self._staging or self.workdir
        self.path = local / "metrics.jsonl"
        existing = self.workdir / "metrics.jsonl"
        if existing.exists():
            kept = [line for line in existing.read_text().splitlines() if _step_of(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")  # noqa: SIM115 (kept open for the run)
        upload_to = self.workdir / "tensorboard" if self._staging is not None else None
        self._events = EventLog(local / "tensorboard", resume_step=resume_step, upload_to=upload_to)

    def sync(self) -> None:
        """Puts every record so far on disk; copies ``metrics.jsonl`` and the events up to a bucket workdir."""
        if not self.enabled:
            return
        self._events.sync()
        if self._staging is not None:
            self._file.flush()
            (self.workdir / "metrics.jsonl").write_bytes(self.path.read_bytes())

    def write(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps(record)
        self._file.write(line + "\n")
        self._file.flush()
        self._events.scalars(int(record["step"]), _flat_scalars(record))
        if self.stdout:
            print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.sync()
            self._file.close()
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
