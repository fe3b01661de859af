"""The training job: data, model, optimizer, steps, evaluation, checkpoints, export.

``train(cfg, workdir)`` resumes from the newest intact checkpoint in ``workdir/checkpoints`` when
there is one, and otherwise starts from ``cfg.train.seed``. A run killed at any point and started
again with the same arguments continues bit for bit where its last checkpoint left off: the data
order is a pure function of the seed and the iterator state (saved in the checkpoint), and the
step is the same compiled program on the same values.

``workdir`` after a run::

    checkpoints/<step>/   Orbax: params (model state, router bias included), opt_state, data_state, config
    metrics.jsonl         one JSON record per logged step (process 0)
    tensorboard/          event files (process 0)
    tokenizer.json        the tokenizer (HF tokenizers' byte-level BPE; ``jaxmoe generate`` needs it)
    tokenizer_config.json its eos token (with tokenizer.json, a folder HF's AutoTokenizer reads)
    export_mxfp4/         the final params, routed experts in MXFP4 (a model checkpoint, jaxmoe.checkpoint.io)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxmoe.checkpoint.manager import CheckpointManager
from jaxmoe.config import (
    MESH_AXES,
    Config,
    ConfigError,
    validate_training,
)
from jaxmoe.data.pipeline import PackedBatches, build_token_data, heldout_batches
from jaxmoe.errors import CheckpointError
from jaxmoe.layer_plan import unstack_layers
from jaxmoe.model import layer_plan
from jaxmoe.paths import Path, is_uri, resolve
from jaxmoe.sharding import make_mesh
from jaxmoe.train.checkpoints import (
    CHECKPOINT_DIR,
    EXPORT_DIR,
    TOKENIZER_FILE,
    export_done,
    stored_config,
    write_export,
    write_sharded_export,
)
from jaxmoe.train.metrics import MetricsWriter, load_summary, measure_peak_flops, model_flops_per_token
from jaxmoe.train.step import STAGES, Trainer, TrainState, deep_merge


def build_mesh(cfg: Config) -> jax.sharding.Mesh:
    """The mesh of ``cfg.mesh`` over every device of every process; a size mismatch names the fields."""
    n = jax.device_count()
    if cfg.mesh.num_devices != n:
        sizes = " x ".join(f"mesh.{a}={getattr(cfg.mesh, a)}" for a in MESH_AXES)
        raise ConfigError(
            f"mesh: {sizes} needs {cfg.mesh.num_devices} devices, but {n} are available "
            f"({jax.process_count()} process(es), platform {jax.devices()[0].platform}); "
            "set the mesh.* sizes so their product is the device count"
        )
    return make_mesh(cfg.mesh)


def _data(cfg: Config, workdir: Path):
    t = cfg.train
    if t.data.cache_dir:
        cache = pathlib.Path(t.data.cache_dir).expanduser()
    elif is_uri(workdir):  # a local cache per host: every host tokenizes the same corpus the same way
        cache = pathlib.Path("~/.cache/jaxmoe/data").expanduser()
    else:
        cache = workdir / "data_cache"
    try:
        data = build_token_data(
            vocab_size=cfg.model.vocab_size,
            max_bytes=t.data.max_bytes,
            heldout_fraction=t.data.heldout_fraction,
            cache_dir=cache,
        )
        batches = PackedBatches(data.train, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed)
        heldout = heldout_batches(data.heldout, seq_len=t.seq_len, batch_size=t.batch_size, num_batches=t.eval_batches)
    except ValueError as e:
        raise ConfigError(
            f"data (data.max_bytes={t.data.max_bytes}, data.heldout_fraction={t.data.heldout_fraction}, "
            f"batch_size={t.batch_size}, seq_len={t.seq_len}, eval_batches={t.eval_batches}): {e}"
        ) from e
    return data, batches, heldout


def _take(tree: dict, like: dict) -> dict:
    """The part of ``tree`` with the keys of ``like``."""
    return {k: _take(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def checkpoint_items(state: TrainState) -> tuple[dict, dict]:
    opt = {"model": state.opt_state}
    if state.indexer_opt_state is not None:
        opt["indexer"] = state.indexer_opt_state
    return deep_merge(state.params, state.router_bias), opt


def _check_same_model(cfg: Config, stored: Config, where: pathlib.Path) -> None:
    if stored.train.scan_layers != cfg.train.scan_layers:
        raise ConfigError(
            f"{where} holds a checkpoint in the {'stacked' if stored.train.scan_layers else 'per-layer'} layout "
            f"(scan_layers={stored.train.scan_layers}); resume with scan_layers={stored.train.scan_layers} "
            "or use a new workdir"
        )
    if stored.model == cfg.model:
        return
    fields = dataclasses.fields(cfg.model)
    diff = [f.name for f in fields if getattr(cfg.model, f.name) != getattr(stored.model, f.name)]
    raise ConfigError(
        f"{where} holds a checkpoint of another model (model.{diff[0]} differs: "
        f"{getattr(stored.model, diff[0])!r} there, {getattr(cfg.model, diff[0])!r} here); use a new workdir"
    )


def restore_latest(ckpt: CheckpointManager, trainer: Trainer, cfg: Config, log) -> tuple[int, TrainState, Any] | None:
    """The newest intact step as ``(step, state, data_state)``; damaged steps are skipped (and said so).

    Raises:
        ConfigError: the checkpoints are of another model.
        CheckpointError: there are checkpoints but none can be restored.
    """
    steps = ckpt.all_steps()
    if not steps:
        return None
    target = trainer.abstract_state()
    params_target, opt_target = checkpoint_items(target)
    for step in reversed(steps):
        try:
            # The config first: a checkpoint of another model is an error, not damage to skip.
            _check_same_model(cfg, stored_config(ckpt.directory, step), ckpt.step_dir(step))
            r = ckpt.restore(step, params=params_target, opt_state=opt_target)
        except CheckpointError as e:
            log(f"checkpoint step {step} cannot be restored, trying an older one: {e}")
            continue
        state = TrainState(
            _take(r.params, target.params),
            _take(r.params, target.router_bias),
            r.opt_state["model"],
            r.opt_state.get("indexer"),
        )
        return step, state, r.data_state
    raise CheckpointError(
        f"none of the checkpoints {steps} in {str(ckpt.directory)!r} can be restored (see above); "
        "move them away to start over"
    )


def _fetch(tree):
    """Replicated device values -> numpy on every process (each holds a full copy)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def export_final(state: TrainState, cfg: Config, workdir: Path, log) -> str:
    """The MXFP4 export of the final params (once): from host copies in a single process; in a
    multi-process run each process quantizes and writes its own shards."""
    dst = workdir / EXPORT_DIR
    if export_done(dst):
        return str(dst)
    tokenizer = workdir / TOKENIZER_FILE
    params = deep_merge(state.params, state.router_bias)
    if cfg.train.scan_layers:  # model checkpoints are per layer
        params = unstack_layers(params, layer_plan(cfg.model))
    if jax.process_count() == 1:
        note = write_export(jax.tree.map(np.asarray, params), cfg, dst, tokenizer)
    else:
        note = write_sharded_export(params, cfg, dst, tokenizer)
    log(f"MXFP4 export: {dst} ({note})")
    return note if note.startswith("skipped") else str(dst)


class _Clock:
    """Training time per step: wall time between logged steps, less what :meth:`exclude` takes out
    (compilation, evaluation, checkpoints)."""

    def __init__(self, step: int):
        self._time, self._step = time.perf_counter(), step

    def exclude(self, seconds: float) -> None:
        self._time += seconds

    def seconds_per_step(self, step: int) -> float:
        """The mean over the steps since the last call (or the start) up to ``step``."""
        now = time.perf_counter()
        per_step = (now - self._time) / (step - self._step)
        self._time, self._step = now, step
        return per_step


@dataclasses.dataclass
class _Run:
    """One training job: what stays fixed for it, then what the loop advances."""

    cfg: Config
    trainer: Trainer
    ckpt: CheckpointManager
    writer: MetricsWriter
    batches: PackedBatches
    heldout: list
    flops_per_token: dict[str, float]  # stage -> model FLOPs per training token
    peak_flops: float  # per device
    step: int  # completed steps
    state: TrainState
    compiled: dict[str, Any] = dataclasses.field(default_factory=dict)  # stage -> its compiled step
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)


def due(step: int, every: int, last: int) -> bool:
    """Whether ``step`` is a multiple of ``every`` (0: never) or the ``last`` step."""
    return bool(every and step % every == 0) or step == last


def _initial_state(cfg: Config, trainer: Trainer, ckpt: CheckpointManager, batches: PackedBatches, log):
    """``(step, state)`` of the newest intact checkpoint (``batches`` restored to it), else of a fresh start."""
    restored = restore_latest(ckpt, trainer, cfg, log)
    if restored is None:
        return 0, trainer.init_state(cfg.train.seed)
    step, state, data_state = restored
    batches.restore(data_state["batches"])
    log(f"resumed from step {step} ({ckpt.step_dir(step)})")
    return step, state


def _advance(run: _Run, clock: _Clock) -> tuple[str, float, dict, dict]:
    """Runs one step (compiling its stage first if new): ``(stage, its learning rate, device metrics,
    record)``, the record holding ``compile_s`` when it compiled."""
    stage = run.trainer.stage(run.step)
    inputs, targets = run.trainer.batch(next(run.batches))
    record: dict[str, Any] = {}
    if stage not in run.compiled:
        start = time.perf_counter()
        run.compiled[stage] = run.trainer.compile_step(stage, run.state, inputs, targets)
        record["compile_s"] = time.perf_counter() - start
        clock.exclude(record["compile_s"])
    lr = run.trainer.learning_rate(run.step)
    run.state, metrics = run.compiled[stage](run.state, inputs, targets)
    run.step += 1
    return stage, lr, metrics, record


def _step_record(run: _Run, stage: str, lr: float, metrics: dict, step_time: float) -> dict:
    """The logged fields of the step just run, from its fetched ``metrics`` and ``step_time`` seconds."""
    cfg = run.cfg
    tokens_per_s = cfg.train.batch_size * cfg.train.seq_len / step_time
    flops = run.flops_per_token[stage]
    return {
        "step": run.step,
        "stage": stage,
        "loss": float(metrics["loss"]),
        "total_loss": float(metrics["total_loss"]),
        "lr": lr,
        "grad_norm": float(metrics["grad_norm"]),
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_time,
        "mfu": flops * tokens_per_s / (run.peak_flops * jax.device_count()),
        **({"indexer_kl": float(metrics["indexer_kl"])} if "dsa" in cfg.model.layer_kinds else {}),
        **({"seq_aux_loss": float(metrics["seq_aux_loss"])} if metrics["expert_load"] else {}),
        **load_summary(metrics["expert_load"], metrics["drop_fraction"]),
    }


def _evaluate(run: _Run) -> float:
    """The mean held-out LM loss of the state, with the attention of the stage that ran last."""
    evaluate = run.trainer.eval_fn(run.trainer.stage(run.step - 1))
    losses = [evaluate(run.state, *run.trainer.batch(b)) for b in run.heldout]
    return float(np.mean([float(_fetch(v)) for v in losses]))


def _write(run: _Run, record: dict) -> None:
    record.setdefault("step", run.step)
    run.writer.write(record)
    run.summary.update({k: v for k, v in record.items() if not isinstance(v, dict)})


def _checkpoint(run: _Run) -> None:
    """Saves the state and the data iterator at this step; the metrics written so far go with it."""
    params, opt = checkpoint_items(run.state)
    data_state = {"batches": run.batches.state(), "step": run.step}
    run.ckpt.save(run.step, params=params, opt_state=opt, data_state=data_state, config=run.cfg, force=True)
    run.summary["checkpoint"] = str(run.ckpt.step_dir(run.step))
    run.writer.sync()


def _loop(run: _Run, bar: tqdm, stop_after: int | None) -> None:
    """Steps until ``cfg.train.steps`` (or ``stop_after``): each logged, evaluated and checkpointed when due."""
    t = run.cfg.train
    clock = _Clock(run.step)
    while run.step < t.steps:
        stage, lr, metrics, record = _advance(run, clock)
        bar.update(1)
        if due(run.step, t.log_every, t.steps) or run.step == stop_after:
            metrics = _fetch(metrics)  # waits for the step: the clock reads after it
            record = {**_step_record(run, stage, lr, metrics, clock.seconds_per_step(run.step)), **record}
            bar.set_postfix(loss=f"{record['loss']:.3f}")
        start = time.perf_counter()  # evaluation and checkpoints are not training time
        if due(run.step, t.eval_every, t.steps):
            record["heldout_loss"] = _evaluate(run)
        if record:
            _write(run, record)
        if due(run.step, t.checkpoint_every, t.steps):
            _checkpoint(run)
        clock.exclude(time.perf_counter() - start)
        if stop_after is not None and run.step >= stop_after:
            break


def _log_fn(is_main: bool):
    if not is_main:
        return lambda msg: None
    return lambda msg: print(f"jaxmoe train: {msg}", file=sys.stderr, flush=True)


def train(
    cfg: Config,
    workdir: str | Path,
    *,
    stop_after: int | None = None,
    progress: bool = True,
    stdout: bool = True,
) -> dict:
    """Trains ``cfg`` in ``workdir`` (resuming from its checkpoints); returns a summary.

    Args:
        cfg: the config; ``cfg.train`` holds the training fields.
        workdir: the run directory (created if missing): a local path or a bucket (``gs://B/P``).
        stop_after: return after this many completed steps (its checkpoint written if one is due),
            as if the job were killed there: no final checkpoint, no export.
        progress: show a progress bar on stderr (process 0).
        stdout: print each metrics record as a JSON line (process 0).

    Returns:
        ``{"step", "loss", "heldout_loss", "checkpoint", "export", ...}`` of the last step run.
    """
    validate_training(cfg)
    t = cfg.train
    workdir = resolve(workdir)
    is_main = jax.process_index() == 0
    log = _log_fn(is_main)
    mesh = build_mesh(cfg)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
    data, batches, heldout = _data(cfg, workdir)
    if is_main:
        data.tokenizer.save(workdir)  # tokenizer.json + tokenizer_config.json
        log(f"data: {len(data.train)} train / {len(data.heldout)} held-out tokens; {data.source}")

    # Before the mesh is set: the measurement runs on this process's devices only.
    peak = t.peak_flops or measure_peak_flops()
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        ckpt = CheckpointManager(workdir / CHECKPOINT_DIR, max_to_keep=t.keep_checkpoints)
        step, state = _initial_state(cfg, trainer, ckpt, batches, log)
        writer = MetricsWriter(workdir, resume_step=step, stdout=stdout, enabled=is_main)
        flops = {stage: model_flops_per_token(cfg, stage) for stage in STAGES}
        run = _Run(cfg, trainer, ckpt, writer, batches, heldout, flops, peak, step, state, summary={"step": step})
        bar = tqdm(total=t.steps, initial=step, disable=not (progress and is_main), file=sys.stderr, unit="step")
        try:
            _loop(run, bar, stop_after)
            ckpt.wait_until_finished()
            run.summary["step"] = run.step
            if run.step == t.steps and t.export_mxfp4 and stop_after is None:
                run.summary["export"] = export_final(run.state, cfg, workdir, log)
        finally:
            bar.close()
            ckpt.close()
            writer.close()
    return run.summary


def summary_line(summary: dict) -> str:
    return json.dumps({"done": True, **summary})
