"""The image-text job (configs/tiny.py:vl): data, baseline, the masked image step, exact match, resume.

References: scikit-learn's ``NearestCentroid`` for the baseline; the model's own dense forward on one
device for the step's loss; a token-by-token greedy decode for the exact-match metric.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.chat.format import IMAGE_TOKEN
from jaxmoe.chat.template import render
from jaxmoe.checkpoint.manager import CheckpointManager
from jaxmoe.config import ConfigError, MeshConfig
from jaxmoe.train.checkpoints import CHECKPOINT_DIR
from jaxmoe.train.loop import build_mesh, restore_latest
from jaxmoe.train.step import Trainer
from jaxmoe.vision import captions, vision_inputs
from jaxmoe.vision.train import (
    answer_hits,
    batch,
    caption_tokenizer,
    examples,
    load_vl_config,
    train_order,
    train_vl,
)

CONFIG = "configs/tiny.py:vl"
SMALL = [("steps", "30"), ("batch_size", "32"), ("eval_every", "0"), ("checkpoint_every", "10"),
         ("export_mxfp4", "false"), ("log_every", "10")]  # fmt: skip


def small_config(extra=()):
    return load_vl_config(CONFIG, [*SMALL, *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 30-step run of the job (stopped at 20 and resumed), and the same 30 steps straight."""
    cfg, vl = small_config()
    resumed = tmp_path_factory.mktemp("vl_resumed")
    first = train_vl(cfg, vl, resumed, stop_after=20, progress=False, stdout=False)
    summary = train_vl(cfg, vl, resumed, progress=False, stdout=False)
    straight = tmp_path_factory.mktemp("vl_straight")
    train_vl(cfg, vl, straight, progress=False, stdout=False)
    return cfg, vl, resumed, straight, first, summary


def _state(cfg, workdir):
    mesh = build_mesh(cfg)
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        with CheckpointManager(workdir / CHECKPOINT_DIR) as ckpt:
            step, state, _ = restore_latest(ckpt, trainer, cfg, print)
    return mesh, trainer, step, state


def test_split_is_seeded_disjoint_and_complete():
    train, held = captions.load("digits", 0.25, 0)
    again, _ = captions.load("digits", 0.25, 0)
    other, _ = captions.load("digits", 0.25, 1)
    assert len(train.labels) + len(held.labels) == 1797 and len(held.labels) == 449
    np.testing.assert_array_equal(train.images, again.images)
    assert not np.array_equal(train.labels, other.labels)
    flat = lambda s: {x.tobytes() for x in s.images}
    assert train.images.dtype == np.uint8 and train.images.shape[1:] == (8, 8, 3)
    assert train.images.max() == 255 and set(np.unique(train.labels)) == set(range(10))
    assert len(flat(train) & flat(held)) < 10  # the set has a few exact duplicate images; no shared rows
    assert held.caption(0) == captions.DIGIT_NAMES[held.labels[0]]


def test_baseline_is_sklearn_nearest_centroid():
    from sklearn.neighbors import NearestCentroid

    train, held = captions.load("digits", 0.25, 0)
    flat = lambda s: s.images.reshape(len(s.images), -1).astype(np.float64)
    ref = NearestCentroid().fit(flat(train), train.labels).score(flat(held), held.labels)
    assert captions.nearest_centroid_accuracy(train, held) == pytest.approx(ref, abs=1e-12)
    assert 0.8 < ref < 0.95


@pytest.mark.parametrize(
    "extra, message",
    [
        ([("vl.dataset", "mnist")], "vl.dataset is 'mnist'; allowed: digits"),
        ([("vl.heldout_fraction", "1.5")], "vl.heldout_fraction must be in (0, 1)"),
        ([("vl.prompt", " ")], "vl.prompt must be a non-empty string"),
        ([("vl.bogus", "1")], "unknown key 'bogus'"),
        ([("model.vision.image_token_id", "5")], "model.vision.image_token_id is 5"),
        ([("batch_size", "30")], "batch_size=30 must divide over the batch's 4 shards"),
    ],
)
def test_bad_config_names_the_field(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        small_config(extra)


def test_job_needs_a_vision_tower():
    from jaxmoe.vision.train import validate_vl

    cfg, vl = small_config()
    text_only = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vision=None))
    with pytest.raises(ConfigError, match="model.vision: the image-text job"):
        validate_vl(text_only, vl)


def test_examples_render_the_chat_turn():
    cfg, vl = small_config()
    tok = caption_tokenizer(vl, cfg.model.vocab_size)
    train, _ = captions.load("digits", 0.25, 0)
    ex = examples(captions.CaptionSet(train.images[:3], train.labels[:3], train.captions), tok, cfg, vl)
    image_id = tok.token_id(IMAGE_TOKEN)
    assert image_id == cfg.model.vision.image_token_id == 11
    assert ex.grid == (4, 4) and ex.pixels.shape == (3, 16, 3, 2, 2)
    text = tok.decode(ex.prompt, skip_special=False)
    assert text == "<|endoftext|><|user|>" + IMAGE_TOKEN * 4 + vl.prompt + "<|end|><|assistant|><|think|><|/think|>"
    assert [tok.decode(a, skip_special=False) for a in ex.answers[:2]] == ["zero<|end|>", "one<|end|>"]
    inputs, targets, mask, images = batch(ex, np.array([0, 2, -1]), cfg)
    assert mask[2].sum() == 0 and inputs.shape[1] % 16 == 0
    # The mask covers exactly the answer: caption and end of turn.
    for row, label in ((0, ex.labels[0]), (1, ex.labels[2])):
        np.testing.assert_array_equal(targets[row][mask[row] == 1], ex.answers[label])
    assert images.patches.shape == (48, 12)


def test_render_refuses_bad_image_parts():
    cfg, vl = small_config()
    tok = caption_tokenizer(vl, cfg.model.vocab_size)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\].tokens is 0"):
        render([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "tokens": 0}]}], tok)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\] is 'video'"):
        render([{"role": "user", "content": [{"type": "image", "tokens": 2}, {"type": "video"}]}], tok)
    from jaxmoe.chat.tokenizer import Tokenizer

    text_tok = Tokenizer.train(["hello"], 300)
    with pytest.raises(ValueError, match="has no '<|image|>' token"):
        render([{"role": "user", "content": [{"type": "image", "tokens": 2}]}], text_tok)


def test_train_order_covers_each_epoch_once():
    n, B = 50, 16
    seen = np.concatenate([train_order(s, n, B, 3) for s in range(6)])  # 96 = one epoch and 46
    assert sorted(seen[:n].tolist()) == list(range(n))
    assert len(set(seen[n:].tolist())) == 46
    np.testing.assert_array_equal(train_order(4, n, B, 3), train_order(4, n, B, 3))


@pytest.mark.parametrize("mesh", [None, MeshConfig(data=2, fsdp=2, tensor=2)], ids=["data4_expert2", "dp2_fsdp2_tp2"])
def test_image_step_loss_equals_dense_masked_cross_entropy(mesh):
    cfg, vl = small_config()
    if mesh is not None:
        cfg = dataclasses.replace(cfg, mesh=mesh)
    tok = caption_tokenizer(vl, cfg.model.vocab_size)
    train, _ = captions.load("digits", 0.25, 0)
    ex = examples(captions.CaptionSet(train.images[:32], train.labels[:32], train.captions), tok, cfg, vl)
    inputs, targets, mask, images = batch(ex, np.arange(32), cfg)
    m = build_mesh(cfg)
    with jax.set_mesh(m):
        trainer = Trainer(cfg, m)
        state = trainer.init_state(cfg.train.seed)
        host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), (state.params, state.router_bias))
        put = lambda a: jax.make_array_from_callback(a.shape, trainer.batch_sharding, lambda i: a[i])
        _, metrics = trainer.image_step_fn("main")(state, put(inputs), put(targets), put(mask), images)
        loss = float(np.asarray(metrics["loss"].addressable_data(0)))
    # One device, host arrays; jitted (the same ops: eager dispatch took ~70 s of this test).
    dense = jax.jit(lambda params, bias, x, im: nnx.merge(trainer.graphdef, params, bias)(x, images=im))
    logits = dense(*host, jnp.asarray(inputs), jax.tree.map(jnp.asarray, images))
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    picked = np.take_along_axis(np.asarray(logp), targets[..., None], axis=-1)[..., 0]
    ref = -(picked * mask).sum() / mask.sum()
    assert loss == pytest.approx(ref, rel=1e-5)


def test_resumed_run_equals_the_straight_run(trained):
    cfg, _, resumed, straight, first, summary = trained
    assert first["step"] == 20 and summary["step"] == 30
    _, _, step_a, a = _state(cfg, resumed)
    _, _, step_b, b = _state(cfg, straight)
    assert step_a == step_b == 30
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert summary["baseline_nearest_centroid"] == pytest.approx(0.893, abs=1e-3)
    assert 0.0 <= summary["heldout_exact_match"] <= 1.0
    assert summary["margin_over_baseline"] == pytest.approx(
        summary["heldout_exact_match"] - summary["baseline_nearest_centroid"]
    )


def test_exact_match_is_greedy_decoding(trained):
    """An example counts as a hit exactly when decoding token by token after its prompt (argmax of a
    full forward each step) produces its caption and the end of turn."""
    cfg, vl, resumed, *_ = trained
    mesh, trainer, _, state = _state(cfg, resumed)
    tok = caption_tokenizer(vl, cfg.model.vocab_size)
    _, held = captions.load("digits", 0.25, 0)
    sub = captions.CaptionSet(held.images[:24], held.labels[:24], held.captions)
    ex = examples(sub, tok, cfg, vl)
    with jax.set_mesh(mesh):
        hits = answer_hits(trainer, state, ex, cfg)
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), (state.params, state.router_bias))
    model = nnx.merge(trainer.graphdef, *host)
    end = ex.answers[0][-1]
    forward = jax.jit(lambda t, im: jnp.argmax(model(t, images=im)[0, -1]))
    for i in range(len(sub.labels)):
        images = jax.tree.map(jnp.asarray, vision_inputs(ex.pixels[i], [ex.grid], cfg.model.vision))
        ids = list(ex.prompt)
        out = []
        while len(out) < 8 and (not out or out[-1] != end):
            out.append(int(forward(jnp.asarray([ids + out]), images)))
        assert (out == ex.answers[ex.labels[i]]) == hits[i], (i, out, hits[i])
    assert hits.any()
