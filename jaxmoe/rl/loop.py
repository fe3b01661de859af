"""The RL job (``jaxmoe rl``): GRPO from a trained checkpoint, rollouts from the inference engine.

Each step takes ``prompts_per_step`` prompts from the domains in turn, samples ``group_size``
completions of each through the :class:`~jaxmoe.inference.engine.Engine` (on the training mesh,
reading the trainer's own sharded parameters), scores them with the domains' verifiers, turns the
rewards into group-relative advantages and takes ``updates_per_batch`` optimizer steps on the
GRPO loss (:mod:`jaxmoe.rl.grpo`). Every sampled token is a pure function of ``rl.seed``, the step
and the weights, so a run killed and started again with the same arguments continues bit for bit
from its last checkpoint.

``workdir`` after a run::

    checkpoints/<step>/   Orbax: params (router biases included), opt_state, data_state, config
    metrics.jsonl         one record per logged step: rewards per domain, clip fractions, KL, ...
    tensorboard/          the same scalars
    tokenizer.json        the --init run's tokenizer

In a multi-process run process 0 schedules the engine (the others follow its steps) and sends
the packed batch to the other processes; the update runs on every process.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.checkpoint.manager import CheckpointManager
from jaxmoe.config import Config
from jaxmoe.errors import CheckpointError
from jaxmoe.inference.engine import Engine, EngineConfig
from jaxmoe.paths import Path, resolve
from jaxmoe.rl.config import RLConfig
from jaxmoe.rl.domains import DOMAINS
from jaxmoe.rl.grpo import group_advantages
from jaxmoe.rl.rollout import HostBatch, group_stats, host_batch, rollout
from jaxmoe.rl.sft import SFTBatch, sft_batch, sft_optimizer, sft_step
from jaxmoe.rl.step import Batch, RLState, RLTrainer
from jaxmoe.train.checkpoints import CHECKPOINT_DIR, TOKENIZER_FILE, stored_config
from jaxmoe.train.loop import _check_same_model, _take, build_mesh
from jaxmoe.train.metrics import MetricsWriter
from jaxmoe.train.step import Trainer, deep_merge

PROMPT_POOL = 512  # training prompts drawn per domain (then cycled)
ROLLOUT_CHUNK = 1024  # the longest prompt a rollout prefills in one step (longer ones take several)
ROLLOUT_STEP_TOKENS = 16384  # prompt tokens of one engine step


# --------------------------------------------------------------------------------------------
# Prompts and seeds: pure functions of the config and the step


def step_prompts(rl: RLConfig, pools: dict[str, list], step: int) -> list:
    """The prompts of ``step``: the domains in turn, each domain's pool walked in order."""
    names = rl.domains
    counts = [sum(1 for k in range(rl.prompts_per_step) if k % len(names) == d) for d in range(len(names))]
    prompts = []
    for k in range(rl.prompts_per_step):
        d = k % len(names)
        pool = pools[names[d]]
        prompts.append(pool[(step * counts[d] + k // len(names)) % len(pool)])
    return prompts


def step_seeds(rl: RLConfig, step: int, n: int) -> list[int]:
    return [(rl.seed * 1_000_003 + step * 100_003 + i * 7 + 1) % 2**32 for i in range(n)]


def eval_seeds(rl: RLConfig, n: int) -> list[int]:
    return [(rl.seed * 7_919 + 2**31 + i * 13) % 2**32 for i in range(n)]


# --------------------------------------------------------------------------------------------
# State: from the --init run, or from this run's own checkpoints


def init_root(init: str | Path) -> tuple[Path, Path]:
    """``(checkpoint root, tokenizer folder)`` of ``--init``: a training workdir or its checkpoints/ root."""
    path = resolve(init)
    if (path / CHECKPOINT_DIR).is_dir():
        return path / CHECKPOINT_DIR, path
    if path.name == CHECKPOINT_DIR and path.is_dir():
        return path, path.parent
    raise CheckpointError(
        f"--init {str(init)!r}: not a training workdir (no {CHECKPOINT_DIR}/ in it) nor its {CHECKPOINT_DIR}/ root"
    )


def _restore_params(root: Path, trainer: Trainer, cfg: Config) -> tuple[dict, dict]:
    with CheckpointManager(root) as mgr:
        step = mgr.latest_step()
        if step is None:
            raise CheckpointError(f"--init: {str(root)!r} holds no complete checkpoint step")
        _check_same_model(cfg, stored_config(root, step), root / str(step))
        target = trainer.abstract_state()
        r = mgr.restore(step, params=deep_merge(target.params, target.router_bias))
    return _take(r.params, target.params), _take(r.params, target.router_bias)


def _resume(ckpt: CheckpointManager, rt: RLTrainer, cfg: Config) -> tuple[int, RLState] | None:
    steps = ckpt.all_steps()
    if not steps:
        return None
    step = steps[-1]
    _check_same_model(cfg, stored_config(ckpt.directory, step), ckpt.step_dir(step))
    target = rt.trainer.abstract_state()
    r = ckpt.restore(step, params=deep_merge(target.params, target.router_bias), opt_state={"model": rt.abstract_opt()})
    return step, RLState(_take(r.params, target.params), _take(r.params, target.router_bias), r.opt_state["model"])


def engine_state(graphdef, params: dict, router_bias: dict):
    """The engine's view of the trainer's arrays (no copy)."""
    return nnx.split(nnx.merge(graphdef, params, router_bias))[1]


# --------------------------------------------------------------------------------------------
# Rollouts on process 0, shared with the others


def _rollouts(engine: Engine, tokenizer, rl: RLConfig, prompts, samples: int, seeds):
    """Process 0 generates (the others run the engine's follower loop meanwhile); None elsewhere."""
    if jax.process_index() != 0:
        engine.follow()
        return None
    try:
        return rollout(
            engine,
            tokenizer,
            prompts,
            samples=samples,
            seeds=seeds,
            budgets=rl.budgets,
            max_tokens=rl.max_tokens,
            temperature=rl.temperature,
            top_p=rl.top_p,
        )
    finally:
        engine.stop_followers()


def _share(host: HostBatch | None, advantages: np.ndarray | None) -> tuple[HostBatch, np.ndarray]:
    """Process 0's batch on every process (a no-op in a single-process run)."""
    if jax.process_count() == 1:
        return host, advantages
    source = jax.process_index() == 0
    shape = np.array(host.allowed.shape if source else (0, 0, 0), np.int64)
    B, T, V = (int(x) for x in multihost_utils.broadcast_one_to_all(shape))
    like = HostBatch(
        np.zeros((B, T), np.int32),
        np.zeros((B, T), np.int32),
        np.zeros((B, T, V), bool),
        np.zeros((B, T), np.float32),
        np.zeros((B, T), np.float32),
    )
    fields = dataclasses.astuple(host) if source else dataclasses.astuple(like)
    adv = advantages if source else np.zeros((B,), np.float32)
    out = multihost_utils.broadcast_one_to_all((*fields, adv))
    return HostBatch(*(np.asarray(a) for a in out[:-1])), np.asarray(out[-1])


def _device_batch(rt: RLTrainer, host: HostBatch, advantages: np.ndarray, state: RLState, ref) -> Batch:
    s = rt.batch_shardings
    put = rt.put
    inputs, targets, allowed = put(host.inputs, s.inputs), put(host.targets, s.targets), put(host.allowed, s.allowed)
    zeros = np.zeros(host.mask.shape, np.float32)
    old = ref_logp = put(zeros, s.old_logp)
    if rt.rl.updates_per_batch > 1:
        old = rt.logprobs(state.params, state.router_bias, inputs, targets, allowed)[0]
    if ref is not None:
        ref_logp = rt.logprobs(ref[0], ref[1], inputs, targets, allowed)[0]
    return Batch(
        inputs,
        targets,
        allowed,
        put(host.mask, s.mask),
        put(host.engine_logp, s.engine_logp),
        put(advantages.astype(np.float32), s.advantages),
        old,
        ref_logp,
    )


def _host_scalars(metrics: dict) -> dict:
    return {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------
# The job


@dataclasses.dataclass
class _Run:
    cfg: Config
    rl: RLConfig
    rt: RLTrainer
    engine: Engine
    tokenizer: Tokenizer
    pools: dict[str, list]
    heldout: list
    ref: tuple[dict, dict] | None
    step: int
    state: RLState
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)


def evaluate(run: _Run) -> dict[str, float] | None:
    """Mean reward per domain on the held-out prompts (fixed seeds); None off process 0."""
    rl = run.rl
    n = len(run.heldout) * rl.eval_samples
    outs = _rollouts(run.engine, run.tokenizer, rl, run.heldout, rl.eval_samples, eval_seeds(rl, n))
    if outs is None:
        return None
    return group_stats(outs, rl.eval_samples)["reward"]


def _advance(run: _Run) -> dict:
    """One step: rollouts, advantages, updates; returns its record (process 0: with the rollout stats)."""
    rl = run.rl
    prompts = step_prompts(rl, run.pools, run.step)
    n = len(prompts) * rl.group_size
    start = time.perf_counter()
    outs = _rollouts(run.engine, run.tokenizer, rl, prompts, rl.group_size, step_seeds(rl, run.step, n))
    host = adv = None
    record: dict[str, Any] = {}
    if outs is not None:
        rewards = np.array([r.reward for r in outs], np.float32)
        adv = np.asarray(group_advantages(rewards, rl.group_size, scale=rl.scale_rewards))
        host = host_batch(outs, run.cfg.model.vocab_size)
        record.update(group_stats(outs, rl.group_size))
        record["rollout_tokens"] = int(sum(len(r.output_ids) for r in outs))
    host, adv = _share(host, adv)
    rollout_s = time.perf_counter() - start
    start = time.perf_counter()
    batch = _device_batch(run.rt, host, adv, run.state, run.ref)
    metrics = []
    for _ in range(rl.updates_per_batch):
        run.state, m = run.rt.step(run.state, batch)
        metrics.append(m)
    run.engine.state = engine_state(run.rt.trainer.graphdef, run.state.params, run.state.router_bias)
    last = _host_scalars(metrics[-1])  # waits for the updates
    train_s = time.perf_counter() - start
    run.step += 1
    record.update(last)
    record.update(
        step=run.step,
        learning_rate=float(run.rt.learning_rate(run.step - 1)),
        rollout_s=rollout_s,
        train_s=train_s,
        rollout_share=rollout_s / (rollout_s + train_s),
        train_tokens=int(host.mask.size),
    )
    if "rollout_tokens" in record:
        record["rollout_tokens_per_s"] = record["rollout_tokens"] / rollout_s
    record["train_tokens_per_s"] = host.mask.size * rl.updates_per_batch / train_s
    return record


def _checkpoint(run: _Run, ckpt: CheckpointManager, writer: MetricsWriter) -> None:
    params = deep_merge(run.state.params, run.state.router_bias)
    data_state = {"step": run.step, "rl": json.loads(json.dumps(dataclasses.asdict(run.rl)))}
    ckpt.save(run.step, params=params, opt_state={"model": run.state.opt_state}, data_state=data_state,
              config=run.cfg, force=True)  # fmt: skip
    run.summary["checkpoint"] = str(ckpt.step_dir(run.step))
    writer.sync()


def _cold_start(run: _Run, writer: MetricsWriter) -> None:
    """``rl.sft.steps`` supervised updates on demonstrations, then the held-out reward after them.

    Cold-start step ``k`` takes the prompts GRPO would take at steps ``rl.steps + k * G`` to
    ``rl.steps + (k + 1) * G - 1`` (G the group size: as many rows as a GRPO batch), training prompts
    only. Every process builds the same host batch (a pure function of the
    config), so nothing is broadcast.
    """
    rl, rt = run.rl, run.rt
    tx = sft_optimizer(rl.sft.learning_rate)
    params_sh, bias_sh = rt.state_shardings.params, rt.state_shardings.router_bias
    opt_sh = rt.trainer._opt_shardings(tx, rt.trainer.abstract_state().params, params_sh)
    rows = rt.batch_shardings.inputs
    replicated = jax.sharding.NamedSharding(rt.mesh, jax.sharding.PartitionSpec())
    step = jax.jit(
        sft_step,
        static_argnums=(0, 1),
        in_shardings=(params_sh, bias_sh, opt_sh, SFTBatch(rows, rows, rows)),
        out_shardings=(params_sh, opt_sh, replicated),
    )
    params, opt = run.state.params, jax.jit(tx.init, out_shardings=opt_sh)(run.state.params)
    losses = []
    for k in tqdm(range(rl.sft.steps), desc="cold start", disable=jax.process_index() != 0, file=sys.stderr):
        walk = range(rl.steps + k * rl.group_size, rl.steps + (k + 1) * rl.group_size)
        prompts = [p for j in walk for p in step_prompts(rl, run.pools, j)]  # prompts_per_step x group_size
        host = sft_batch(prompts, run.tokenizer, rl.budgets, rl.max_tokens)
        batch = SFTBatch(*(rt.put(a, rows) for a in host))
        params, opt, loss = step(rt.trainer.graphdef, rl.sft.learning_rate, params, run.state.router_bias, opt, batch)
        losses.append(float(np.asarray(loss.addressable_data(0))))
    run.state = RLState(params, run.state.router_bias, run.state.opt_state)
    run.engine.state = engine_state(rt.trainer.graphdef, params, run.state.router_bias)
    record = {"step": 0, "sft_steps": rl.sft.steps, "sft_loss_first": losses[0], "sft_loss_last": losses[-1]}
    held = evaluate(run)
    if held is not None:
        record["heldout_reward_sft"] = held
        run.summary["heldout_reward_sft"] = held
    writer.write(record)


def _due(step: int, every: int, last: int) -> bool:
    return bool(every and step % every == 0) or step == last


def _loop(run: _Run, ckpt, writer, bar, stop_after: int | None) -> None:
    rl = run.rl
    if run.step == 0:
        initial = evaluate(run)
        if initial is not None:
            writer.write({"step": 0, "heldout_reward": initial})
            run.summary["heldout_reward_initial"] = initial
        if rl.sft.steps:
            _cold_start(run, writer)
    while run.step < rl.steps:
        record = _advance(run)
        bar.update(1)
        if "reward_mean" in record:
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}")
        if _due(run.step, rl.eval_every, rl.steps):
            held = evaluate(run)
            if held is not None:
                record["heldout_reward"] = held
                run.summary["heldout_reward"] = held
        if _due(run.step, rl.log_every, rl.steps) or "heldout_reward" in record:
            writer.write(record)
        run.summary.update({k: v for k, v in record.items() if k in ("step", "reward_mean", "loss")})
        if _due(run.step, rl.checkpoint_every, rl.steps):
            _checkpoint(run, ckpt, writer)
        if stop_after is not None and run.step >= stop_after:
            break


def _engine(cfg: Config, rl: RLConfig, model, tokenizer: Tokenizer, mesh) -> Engine:
    batch = rl.prompts_per_step * rl.group_size  # a step's rollouts (an evaluation's: seqs)
    seqs = max(batch, rl.eval_prompts * len(rl.domains) * rl.eval_samples)
    # A whole batch's prompts prefill in one step (chunks up to ROLLOUT_CHUNK, ROLLOUT_STEP_TOKENS in
    # all), and every decode step is padded to all the rows and to the page table of the longest
    # turn, so a rollout meets a handful of step shapes, the same ones every step. Smaller budgets
    # spread the prefill over many steps of mixed prefill and decode rows, and rows finishing at
    # different steps made each power of two of rows a shape: a few new shapes a step, and with the
    # compiled programs capped (EngineConfig.max_programs) they kept recompiling (measured on the
    # default run: 26-94 s a rollout, against 1.5-3 s once its programs are compiled).
    config = EngineConfig(
        cache_bytes=rl.cache_bytes,
        max_seqs=seqs,
        snapshot_slots=0,
        step_tokens=max(ROLLOUT_STEP_TOKENS, seqs),
        chunk_size=ROLLOUT_CHUNK,
        prefix_cache=False,  # the weights change every step: a prefix computed before is stale
        min_decode_rows=batch,
        min_context=ROLLOUT_CHUNK + rl.max_tokens,
    )
    return Engine(model, config, eos_id=tokenizer.eos_id, detokenize=tokenizer.decode, mesh=mesh)


def _log_fn(is_main: bool):
    if not is_main:
        return lambda msg: None
    return lambda msg: print(f"jaxmoe rl: {msg}", file=sys.stderr, flush=True)


def train_rl(
    cfg: Config,
    rl: RLConfig,
    workdir: str | Path,
    init: str | Path,
    *,
    stop_after: int | None = None,
    progress: bool = True,
    stdout: bool = True,
) -> dict:
    """GRPO on ``cfg``'s model from the ``init`` run, in ``workdir`` (resuming from its checkpoints).

    Args:
      cfg: the model and mesh (the model must be the one ``init`` holds).
      rl: the RL config.
      workdir: the run directory (created if missing).
      init: a training workdir (its newest checkpoint and tokenizer) or its checkpoints/ root.
      stop_after: return after this many completed steps, as if killed there.
      progress, stdout: the progress bar and the metrics lines (process 0).

    Returns:
      ``{"step", "reward_mean", "loss", "heldout_reward_initial", "heldout_reward", "checkpoint"}``, and
      ``"heldout_reward_sft"`` after a cold start (``rl.sft``).
    """
    workdir = resolve(workdir)
    is_main = jax.process_index() == 0
    log = _log_fn(is_main)
    root, tokenizer_dir = init_root(init)
    if not (tokenizer_dir / TOKENIZER_FILE).exists():
        raise CheckpointError(f"--init: {str(tokenizer_dir)!r} has no {TOKENIZER_FILE} (rollouts need the tokenizer)")
    tokenizer = Tokenizer.load(tokenizer_dir)
    mesh = build_mesh(cfg)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(workdir)
    pools = {d: DOMAINS[d].prompts("train", PROMPT_POOL, rl.seed) for d in rl.domains}
    heldout = [p for d in rl.domains for p in DOMAINS[d].prompts("heldout", rl.eval_prompts, rl.seed)]
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        rt = RLTrainer(trainer, rl)
        ckpt = CheckpointManager(workdir / CHECKPOINT_DIR, max_to_keep=rl.keep_checkpoints)
        resumed = _resume(ckpt, rt, cfg)
        ref = None
        if resumed is None or rl.beta > 0:
            ref = _restore_params(root, trainer, cfg)
        if resumed is None:
            step, state = 0, RLState(ref[0], ref[1], rt.init_opt(ref[0]))
            log(f"from {root} ({len(jax.devices())} devices)")
        else:
            step, state = resumed
            log(f"resumed from step {step} ({ckpt.step_dir(step)})")
        if rl.beta == 0:
            ref = None
        model = nnx.merge(trainer.graphdef, state.params, state.router_bias)
        engine = _engine(cfg, rl, model, tokenizer, mesh)
        writer = MetricsWriter(workdir, resume_step=step, stdout=stdout, enabled=is_main)
        run = _Run(cfg, rl, rt, engine, tokenizer, pools, heldout, ref, step, state, summary={"step": step})
        bar = tqdm(total=rl.steps, initial=step, disable=not (progress and is_main), file=sys.stderr, unit="step")
        try:
            _loop(run, ckpt, writer, bar, stop_after)
            ckpt.wait_until_finished()
        finally:
            bar.close()
            ckpt.close()
            writer.close()
    return run.summary
