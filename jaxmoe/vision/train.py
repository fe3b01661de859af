"""The image-text training job: a model with a vision tower learns to caption a labelled image set.

    jaxmoe train --config configs/tiny.py:vl --workdir /tmp/tiny_vl

A config with a ``vl`` section (:class:`VLConfig`) next to its model (which has a ``vision``
section), mesh and training fields runs this job instead of text pre-training. Every example is
one chat turn in the native format, as the server renders it: the user sends the image and
``vl.prompt``, the assistant answers the caption with thinking off::

    <|endoftext|><|user|><|image|> x M {prompt}<|end|><|assistant|><|think|><|/think|>{caption}<|end|>

The loss is the cross-entropy of the answer's tokens (caption and end of turn); the image and the
prompt are context. The step is the training step (:meth:`jaxmoe.train.step.Trainer.image_step_fn`:
the same optimizer, schedule, MoE balancing and shardings as text training) with the images' patches
and a loss mask.

Evaluation is exact match on the held-out split: the answer counts when the model's argmax at every
answer position is the answer's token, which is exactly when greedy decoding after the prompt
produces the caption and the end of turn. The baseline is the nearest centroid on raw pixels on the
same split (:func:`jaxmoe.vision.captions.nearest_centroid_accuracy`).

The tokenizer is a byte-level BPE trained on the prompt and the captions, with the native special
tokens and ``<|image|>`` (id 11, which ``model.vision.image_token_id`` must name). The data order is
a pure function of ``seed`` and the step, so a resumed run (from ``workdir/checkpoints``) continues
bit for bit. ``workdir`` gets what a text run writes (checkpoints, metrics.jsonl, tensorboard,
tokenizer files, the MXFP4 export), which ``jaxmoe generate --image`` and ``jaxmoe serve`` load.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxmoe.chat.format import IMAGE_TOKEN, NATIVE, VISION_SPECIAL_TOKENS
from jaxmoe.chat.template import render
from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.checkpoint.manager import CheckpointManager
from jaxmoe.config import Config, ConfigError, _build, _to_plain, from_config_dict, load_config_dict
from jaxmoe.paths import resolve
from jaxmoe.rl.rollout import pack
from jaxmoe.train.checkpoints import CHECKPOINT_DIR
from jaxmoe.train.loop import build_mesh, checkpoint_items, due, export_final, restore_latest
from jaxmoe.train.metrics import MetricsWriter
from jaxmoe.train.overrides import apply_overrides, section_overrides
from jaxmoe.train.step import Trainer, TrainState, set_dense_dsa
from jaxmoe.vision import captions
from jaxmoe.vision.layout import VisionInputs, merged_tokens, vision_inputs
from jaxmoe.vision.preprocess import preprocess


@dataclasses.dataclass(frozen=True)
class VLConfig:
    """The image-text job (the ``vl`` section).

    Attributes:
      dataset: the labelled image set (:data:`jaxmoe.vision.captions.DATASETS`).
      heldout_fraction: the share of the set held out for evaluation.
      split_seed: the seed of the train / held-out permutation.
      prompt: the user's text after the image.
    """

    dataset: str = "digits"
    heldout_fraction: float = 0.25
    split_seed: int = 0
    prompt: str = "What digit is this?"


def load_vl_config(path: str, overrides: Sequence[tuple[str, str]] = ()) -> tuple[Config, VLConfig]:
    """The training config and the ``vl`` section of the config file ``path`` (``FILE`` or ``FILE:ARG``);
    ``--config.vl.KEY=VALUE`` sets a field of the section, any other key the training part."""
    d: dict[str, Any] = _to_plain(load_config_dict(path))
    if "vl" not in d:
        raise ConfigError(f"config {path!r} has no 'vl' section (e.g. configs/tiny.py:vl)")
    vl = d.pop("vl")
    if not isinstance(vl, dict):
        raise ConfigError(f"config field vl must be a mapping of image-text fields, got {vl!r}")
    ours = [o for o in overrides if o[0].startswith("vl.")]
    cfg = from_config_dict(apply_overrides(d, [o for o in overrides if o not in ours]))
    vl_cfg = _build(VLConfig, section_overrides(vl, ours, VLConfig()), "vl.")
    validate_vl(cfg, vl_cfg)
    return cfg, vl_cfg


def validate_vl(cfg: Config, vl: VLConfig) -> None:
    """Raises :class:`ConfigError` naming the field when the job cannot run as configured."""
    if cfg.model.vision is None:
        raise ConfigError("model.vision: the image-text job (a vl section) needs a model with a vision tower")
    if vl.dataset not in captions.DATASETS:
        raise ConfigError(f"vl.dataset is {vl.dataset!r}; allowed: {', '.join(captions.DATASETS)}")
    if not 0.0 < vl.heldout_fraction < 1.0:
        raise ConfigError(f"vl.heldout_fraction must be in (0, 1), got {vl.heldout_fraction}")
    if not vl.prompt.strip():
        raise ConfigError("vl.prompt must be a non-empty string")
    image_id = VISION_SPECIAL_TOKENS.index(IMAGE_TOKEN)
    if cfg.model.vision.image_token_id != image_id:
        raise ConfigError(
            f"model.vision.image_token_id is {cfg.model.vision.image_token_id}; the job's tokenizer gives "
            f"{IMAGE_TOKEN} the id {image_id}, set it to {image_id}"
        )
    shards = cfg.mesh.data * cfg.mesh.fsdp
    if cfg.train.batch_size % shards:
        raise ConfigError(
            f"batch_size={cfg.train.batch_size} must divide over the batch's {shards} shards (mesh.data x mesh.fsdp)"
        )


def caption_tokenizer(vl: VLConfig, vocab_size: int) -> Tokenizer:
    """The job's tokenizer: a byte-level BPE of the prompt and the captions, with ``<|image|>``."""
    names = captions.DIGIT_NAMES if vl.dataset == "digits" else ()
    return Tokenizer.train([vl.prompt, *names], vocab_size, special_tokens=VISION_SPECIAL_TOKENS)


class Examples(NamedTuple):
    """One split as model inputs: every example the same image grid and prompt."""

    prompt: list[int]  # the rendered prompt (image placeholders, text, generation prompt)
    answers: list[list[int]]  # per caption class: the caption's ids and the end of turn
    pixels: np.ndarray  # [N, patches per image, 3, p, p] float32
    grid: tuple[int, int]  # each image's patch grid
    labels: np.ndarray  # [N]


def examples(split: captions.CaptionSet, tokenizer: Tokenizer, cfg: Config, vl: VLConfig) -> Examples:
    vision = cfg.model.vision
    pixels, grids = zip(*(preprocess([image], vision) for image in split.images), strict=True)
    shapes = {tuple(g[0, 1:]) for g in grids}
    if len(shapes) != 1:
        raise ValueError(f"the {vl.dataset} images preprocess to several patch grids {sorted(shapes)}")
    grid = tuple(int(v) for v in shapes.pop())
    tokens = merged_tokens([grid], vision)
    content = [{"type": "image", "tokens": tokens}, {"type": "text", "text": vl.prompt}]
    prompt = render([{"role": "user", "content": content}], tokenizer, thinking=False)
    end = tokenizer.token_id(NATIVE.end)
    answers = [[*tokenizer.encode(c), end] for c in split.captions]
    return Examples(prompt, answers, np.stack(pixels), grid, split.labels)


def batch(ex: Examples, index: np.ndarray, cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray, VisionInputs]:
    """``(inputs, targets, mask [B, T], images)`` of examples ``index``; an index of -1 is padding
    (an example with its mask all 0)."""
    valid = index >= 0
    take = np.where(valid, index, 0)
    multiple = 16 * cfg.mesh.context  # few shapes; whole KDA chunks on every context shard
    tokens, mask = pack([(ex.prompt, ex.answers[ex.labels[i]]) for i in take], multiple)
    mask = mask * valid[:, None]
    pixels = ex.pixels[take].reshape(-1, *ex.pixels.shape[2:])
    images = vision_inputs(pixels, [ex.grid] * len(take), cfg.model.vision)
    return tokens[:, :-1], tokens[:, 1:], mask, images


def train_order(step: int, n: int, batch_size: int, seed: int) -> np.ndarray:
    """The examples of the batch after ``step`` completed steps: epochs of seeded permutations."""
    out = []
    position = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, n)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        take = order[offset : offset + batch_size - len(out)]
        out.extend(take.tolist())
        position += len(take)
    return np.asarray(out, np.int64)


def predict(graphdef, params: dict, router_bias: dict, inputs, images) -> jax.Array:
    """Greedy next tokens ``[B, T]`` int32 (sparse DSA, as at inference)."""
    model = nnx.merge(graphdef, params, router_bias)
    set_dense_dsa(model, False)
    return jnp.argmax(model(inputs, images=images), axis=-1).astype(jnp.int32)


def answer_hits(trainer: Trainer, state: TrainState, ex: Examples, cfg: Config) -> np.ndarray:
    """``[N]`` bool: whether each example's whole answer is the model's greedy continuation of its prompt."""
    jitted = jax.jit(
        predict,
        static_argnums=0,
        in_shardings=(trainer.state_shardings.params, trainer.state_shardings.router_bias, trainer.batch_sharding,
                      trainer.replicated),
        out_shardings=trainer.replicated,
    )  # fmt: skip
    B, n = cfg.train.batch_size, len(ex.labels)
    hits = np.zeros(n, bool)
    for start in range(0, n, B):
        index = np.arange(start, start + B)
        index[index >= n] = -1
        inputs, targets, mask, images = batch(ex, index, cfg)
        guess = jitted(trainer.graphdef, state.params, state.router_bias, _put(trainer, inputs), images)
        right = (np.asarray(guess.addressable_data(0)) == targets) | (mask == 0)
        valid = index >= 0
        hits[index[valid]] = right.all(axis=1)[valid]
    return hits


def exact_match(trainer: Trainer, state: TrainState, ex: Examples, cfg: Config) -> float:
    """The share of ``ex`` answered exactly (:func:`answer_hits`)."""
    return float(np.mean(answer_hits(trainer, state, ex, cfg)))


def _put(trainer: Trainer, a: np.ndarray) -> jax.Array:
    """A host batch (the same on every process) as a global array over the batch axes."""
    return jax.make_array_from_callback(a.shape, trainer.batch_sharding, lambda i: a[i])


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxmoe train (vl): {msg}", file=sys.stderr, flush=True)


def train_vl(
    cfg: Config, vl: VLConfig, workdir, *, stop_after: int | None = None, progress: bool = True, stdout: bool = True
) -> dict:
    """Trains ``cfg`` on ``vl``'s image set in ``workdir`` (resuming from its checkpoints).

    Returns:
        ``{"step", "loss", "heldout_exact_match", "baseline_nearest_centroid", "checkpoint", "export", ...}``.
    """
    validate_vl(cfg, vl)
    t = cfg.train
    workdir = resolve(workdir)
    is_main = jax.process_index() == 0
    mesh = build_mesh(cfg)
    train_split, held_split = captions.load(vl.dataset, vl.heldout_fraction, vl.split_seed)
    tokenizer = caption_tokenizer(vl, cfg.model.vocab_size)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is below the tokenizer's {tokenizer.vocab_size}")
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(workdir)
    train_ex = examples(train_split, tokenizer, cfg, vl)
    held_ex = examples(held_split, tokenizer, cfg, vl)
    baseline = captions.nearest_centroid_accuracy(train_split, held_split)
    _log(f"{vl.dataset}: {len(train_split.labels)} train / {len(held_split.labels)} held-out images; "
         f"nearest-centroid baseline {baseline:.4f}")  # fmt: skip
    summary: dict[str, Any] = {"baseline_nearest_centroid": baseline}
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        ckpt = CheckpointManager(workdir / CHECKPOINT_DIR, max_to_keep=t.keep_checkpoints)
        restored = restore_latest(ckpt, trainer, cfg, _log)
        step, state = (restored[0], restored[1]) if restored else (0, trainer.init_state(t.seed))
        writer = MetricsWriter(workdir, resume_step=step, stdout=stdout, enabled=is_main)
        summary["step"] = step
        steps = {stage: trainer.image_step_fn(stage) for stage in ("warmup", "main")}
        put = lambda a: _put(trainer, a)
        bar = tqdm(total=t.steps, initial=step, disable=not (progress and is_main), file=sys.stderr, unit="step")
        try:
            while step < t.steps:
                stage, lr = trainer.stage(step), trainer.learning_rate(step)
                inputs, targets, mask, images = batch(train_ex, train_order(step, len(train_ex.labels), t.batch_size,
                                                                             t.seed), cfg)  # fmt: skip
                state, metrics = steps[stage](state, put(inputs), put(targets), put(mask), images)
                step += 1
                bar.update(1)
                record: dict[str, Any] = {}
                if due(step, t.log_every, t.steps) or step == stop_after:
                    m = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), metrics)
                    record = {"step": step, "stage": stage, "loss": float(m["loss"]), "lr": lr,
                              "grad_norm": float(m["grad_norm"])}  # fmt: skip
                    bar.set_postfix(loss=f"{record['loss']:.3f}")
                if due(step, t.eval_every, t.steps):
                    record["heldout_exact_match"] = exact_match(trainer, state, held_ex, cfg)
                    record["baseline_nearest_centroid"] = baseline
                if record:
                    record.setdefault("step", step)
                    writer.write(record)
                    summary.update(record)
                summary["step"] = step
                if due(step, t.checkpoint_every, t.steps):
                    params, opt = checkpoint_items(state)
                    ckpt.save(step, params=params, opt_state=opt, data_state={"step": step}, config=cfg, force=True)
                    summary["checkpoint"] = str(ckpt.step_dir(step))
                    writer.sync()
                if stop_after is not None and step >= stop_after:
                    break
            ckpt.wait_until_finished()
            if step == t.steps and stop_after is None:
                if "heldout_exact_match" not in summary:
                    summary["heldout_exact_match"] = exact_match(trainer, state, held_ex, cfg)
                summary["margin_over_baseline"] = summary["heldout_exact_match"] - baseline
                if t.export_mxfp4:
                    summary["export"] = export_final(state, cfg, workdir, _log)
        finally:
            bar.close()
            ckpt.close()
            writer.close()
    return summary
