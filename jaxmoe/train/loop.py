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
    tokenizer.json        the BPE tokenizer (``jaxmoe generate`` needs it)
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
from jaxmoe.paths import Path, is_uri, resolve
from jaxmoe.sharding import make_mesh
from jaxmoe.train.checkpoints import (
    CHECKPOINT_DIR,
    EXPORT_DIR,
    TOKENIZER_FILE,
    export_done,
    export_in_subprocess,
    stored_config,
    write_export,
)
from jaxmoe.train.metrics import MetricsWriter, load_summary, measure_peak_flops, model_flops_per_token
from jaxmoe.train.step import Trainer, TrainState, deep_merge


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


def _checkpoint_items(state: TrainState) -> tuple[dict, dict]:
    opt = {"model": state.opt_state}
    if state.indexer_opt_state is not None:
        opt["indexer"] = state.indexer_opt_state
    return deep_merge(state.params, state.router_bias), opt


def _check_same_model(cfg: Config, stored: Config, where: pathlib.Path) -> None:
    if stored.model == cfg.model:
        return
    fields = dataclasses.fields(cfg.model)
    diff = [f.name for f in fields if getattr(cfg.model, f.name) != getattr(stored.model, f.name)]
    raise ConfigError(
        f"{where} holds a checkpoint of another model (model.{diff[0]} differs: "
        f"{getattr(stored.model, diff[0])!r} there, {getattr(cfg.model, diff[0])!r} here); use a new workdir"
    )


def _restore(ckpt: CheckpointManager, trainer: Trainer, cfg: Config, log) -> tuple[int, TrainState, Any] | None:
    """The newest intact step as ``(step, state, data_state)``; damaged steps are skipped (and said so).

    Raises:
        ConfigError: the checkpoints are of another model.
        CheckpointError: there are checkpoints but none can be restored.
    """
    steps = ckpt.all_steps()
    if not steps:
        return None
    target = trainer.abstract_state()
    params_target, opt_target = _checkpoint_items(target)
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


def _export(state: TrainState, cfg: Config, ckpt: CheckpointManager, step: int, workdir: Path, log) -> str:
    """The MXFP4 export of the final params (once): in process when single-process, else from the checkpoint."""
    dst = workdir / EXPORT_DIR
    if export_done(dst):
        return str(dst)
    tokenizer = workdir / TOKENIZER_FILE
    if jax.process_count() == 1:
        host = jax.tree.map(np.asarray, deep_merge(state.params, state.router_bias))
        note = write_export(host, cfg, dst, tokenizer)
    else:
        note = ""
        if jax.process_index() == 0:
            note = export_in_subprocess(ckpt.directory, step, dst, tokenizer)
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices("jaxmoe_export")
    log(f"MXFP4 export: {dst} ({note})")
    return note if note.startswith("skipped") else str(dst)


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
    log = (lambda msg: print(f"jaxmoe train: {msg}", file=sys.stderr, flush=True)) if is_main else (lambda msg: None)
    mesh = build_mesh(cfg)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
    data, batches, heldout = _data(cfg, workdir)
    tokenizer_file = workdir / TOKENIZER_FILE
    if is_main:
        data.tokenizer.save(tokenizer_file)
        log(f"data: {len(data.train)} train / {len(data.heldout)} held-out tokens; {data.source}")

    # Before the mesh is set: the measurement runs on this process's devices only.
    peak = t.peak_flops or measure_peak_flops()
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        ckpt = CheckpointManager(workdir / CHECKPOINT_DIR, max_to_keep=t.keep_checkpoints)
        restored = _restore(ckpt, trainer, cfg, log)
        if restored is None:
            step, state = 0, trainer.init_state(t.seed)
        else:
            step, state, data_state = restored
            batches.restore(data_state["batches"])
            log(f"resumed from step {step} ({ckpt.step_dir(step)})")
        writer = MetricsWriter(workdir, resume_step=step, stdout=stdout, enabled=is_main)
        tokens_per_step = t.batch_size * t.seq_len
        flops_per_token = {stage: model_flops_per_token(cfg, stage) for stage in ("warmup", "main")}
        compiled: dict[str, Any] = {}
        summary: dict[str, Any] = {"step": step}
        bar = tqdm(total=t.steps, initial=step, disable=not (progress and is_main), file=sys.stderr, unit="step")
        try:
            last_time, last_step = time.perf_counter(), step
            while step < t.steps:
                stage = trainer.stage(step)
                inputs, targets = trainer.batch(next(batches))
                record: dict[str, Any] = {}
                if stage not in compiled:
                    start = time.perf_counter()
                    compiled[stage] = trainer.compile_step(stage, state, inputs, targets)
                    record["compile_s"] = time.perf_counter() - start
                    last_time += record["compile_s"]
                lr = trainer.learning_rate(step)
                state, metrics = compiled[stage](state, inputs, targets)
                step += 1
                bar.update(1)
                if step % t.log_every == 0 or step == t.steps or step == stop_after:
                    metrics = _fetch(metrics)
                    now = time.perf_counter()
                    step_time = (now - last_time) / (step - last_step)
                    last_time, last_step = now, step
                    tokens_per_s = tokens_per_step / step_time
                    flops = flops_per_token[stage]
                    record = {
                        "step": step,
                        "stage": stage,
                        "loss": float(metrics["loss"]),
                        "total_loss": float(metrics["total_loss"]),
                        "lr": lr,
                        "grad_norm": float(metrics["grad_norm"]),
                        "tokens_per_s": tokens_per_s,
                        "step_time_s": step_time,
                        "mfu": flops * tokens_per_s / (peak * jax.device_count()),
                        **({"indexer_kl": float(metrics["indexer_kl"])} if "dsa" in cfg.model.layer_kinds else {}),
                        **({"seq_aux_loss": float(metrics["seq_aux_loss"])} if metrics["expert_load"] else {}),
                        **load_summary(metrics["expert_load"], metrics["drop_fraction"]),
                        **record,
                    }
                    bar.set_postfix(loss=f"{record['loss']:.3f}")
                start = time.perf_counter()  # evaluation and checkpoints are not training time
                if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                    evaluate = trainer.eval_fn(trainer.stage(step - 1))
                    losses = [evaluate(state, *trainer.batch(b)) for b in heldout]
                    record["heldout_loss"] = float(np.mean([float(_fetch(v)) for v in losses]))
                if record:
                    record.setdefault("step", step)
                    writer.write(record)
                    summary.update({k: v for k, v in record.items() if not isinstance(v, dict)})
                if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps:
                    params, opt = _checkpoint_items(state)
                    data_state = {"batches": batches.state(), "step": step}
                    ckpt.save(step, params=params, opt_state=opt, data_state=data_state, config=cfg, force=True)
                    summary["checkpoint"] = str(ckpt.step_dir(step))
                    writer.sync()
                last_time += time.perf_counter() - start
                if stop_after is not None and step >= stop_after:
                    break
            ckpt.wait_until_finished()
            summary["step"] = step
            if step == t.steps and t.export_mxfp4 and stop_after is None:
                summary["export"] = _export(state, cfg, ckpt, step, workdir, log)
        finally:
            bar.close()
            ckpt.close()
            writer.close()
    return summary


def summary_line(summary: dict) -> str:
    return json.dumps({"done": True, **summary})
