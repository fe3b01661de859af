"""The engine with images, on the tiny model with a vision tower (configs/tiny.py:vl, random weights).

Reference: the model's own dense forward with ``images`` (the tower's features scattered into the
placeholders), greedy one position at a time.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx
from inference_helpers import inference_model_config, small_engine

from jaxmoe.config import load_config
from jaxmoe.inference import Images, Request
from jaxmoe.model import create_model
from jaxmoe.vision import vision_inputs
from jaxmoe.vision.layout import image_grids, merged_tokens
from jaxmoe.vision.preprocess import preprocess
from jaxmoe.vision.train import load_vl_config


@pytest.fixture(scope="module")
def model():
    cfg = inference_model_config(load_vl_config("configs/tiny.py:vl")[0].model)
    cfg = dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, topk=8))
    return create_model(cfg, seed=0)


def _images(shapes, seed):
    """Random RGB images of ``shapes`` (H, W), preprocessed, and their placeholder count."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]


def _request_images(model, arrays) -> tuple[Images, int]:
    pixel_values, grid = preprocess(arrays, model.cfg.vision)
    return Images(pixel_values, grid), merged_tokens(image_grids(grid, model.cfg.vision), model.cfg.vision)


def _prompt(model, pieces, seed):
    """Text tokens and runs of placeholders: ``pieces`` of ints (text lengths) and ``("img", n)``."""
    rng = np.random.default_rng(seed)
    image_id = model.cfg.vision.image_token_id
    out = []
    for p in pieces:
        if isinstance(p, tuple):
            out += [image_id] * p[1]
        else:
            out += [t if t != image_id else t + 1 for t in rng.integers(0, model.cfg.vocab_size, p).tolist()]
    return tuple(out)


@functools.partial(jax.jit, static_argnums=0)
def _dense(graphdef, state, tokens, inputs):
    return nnx.merge(graphdef, state)(tokens, images=inputs)


def _dense_greedy(model, prompt, images: Images, n):
    """The dense forward with the images, argmax one position at a time (a fixed 64-token buffer)."""
    graphdef, state = nnx.split(model)
    inputs = vision_inputs(images.pixel_values, image_grids(images.grid_thw, model.cfg.vision), model.cfg.vision)
    toks = list(prompt)
    for _ in range(n):
        buf = np.zeros((1, 64), np.int32)
        buf[0, : len(toks)] = toks
        row = np.asarray(_dense(graphdef, state, buf, inputs))[0, len(toks) - 1]
        toks.append(int(np.argmax(row)))
        assert toks[-1] != model.cfg.vision.image_token_id  # it would read as a placeholder here
    return toks[len(prompt) :]


def test_images_in_a_batch_equal_the_dense_forward(model):
    """Two images of different sizes in one prompt, one in another, a text-only row beside them;
    chunks of 8 split the images' tokens across prefill steps."""
    two, n_two = _request_images(model, _images([(8, 8), (12, 8)], seed=1))
    one, n_one = _request_images(model, _images([(8, 12)], seed=2))
    assert (n_two, n_one) == (4 + 6, 6)
    prompts = [
        _prompt(model, [3, ("img", 4), 5, ("img", 6), 2], seed=3),
        _prompt(model, [7, ("img", n_one), 4], seed=6),
        _prompt(model, [13], seed=12),
    ]
    engine = small_engine(model, chunk_size=8, step_tokens=24)
    outs = engine.generate(
        [
            Request(prompts[0], max_tokens=6, images=two),
            Request(prompts[1], max_tokens=6, images=one),
            Request(prompts[2], max_tokens=6),
        ]  # fmt: skip
    )
    assert outs[0].output_ids == _dense_greedy(model, prompts[0], two, 6)
    assert outs[1].output_ids == _dense_greedy(model, prompts[1], one, 6)
    assert [o.image_tokens for o in outs] == [n_two, n_one, 0]
    assert engine.stats["image_encodes"] == 3
    # the images matter: other pixels, other tokens
    other, _ = _request_images(model, _images([(8, 12)], seed=9))
    assert small_engine(model).generate([Request(prompts[1], max_tokens=6, images=other)])[0].output_ids != (
        outs[1].output_ids
    )


def test_prefix_reuse_follows_the_images_not_the_placeholder_ids(model):
    """The next turn with the same image reuses its prefix and features; the same ids with another
    image share only the text before it; the result always equals a cold start."""
    image, n = _request_images(model, _images([(8, 8)], seed=6))
    other, _ = _request_images(model, _images([(8, 8)], seed=7))
    head = _prompt(model, [10], seed=8)
    turn1 = head + _prompt(model, [("img", n), 9], seed=8)
    engine = small_engine(model)
    first = engine.generate([Request(turn1, max_tokens=5, tenant="alice", images=image)])[0]
    history = turn1 + tuple(first.output_ids) + _prompt(model, [6], seed=10)
    second = engine.generate([Request(history, max_tokens=5, tenant="alice", images=image)])[0]
    assert second.cached_tokens == len(turn1) + len(first.output_ids) - 1
    assert engine.stats["image_encodes"] == 1  # the tower ran once for both turns
    cold = small_engine(model, prefix_cache=False).generate([Request(history, max_tokens=5, images=image)])[0]
    assert second.output_ids == cold.output_ids
    np.testing.assert_allclose(second.logprobs, cold.logprobs, atol=1e-4)

    swapped = engine.generate([Request(history, max_tokens=5, tenant="alice", images=other)])[0]
    assert swapped.cached_tokens <= len(head)  # nothing past the first image token
    cold = small_engine(model, prefix_cache=False).generate([Request(history, max_tokens=5, images=other)])[0]
    assert swapped.output_ids == cold.output_ids
    # another tenant neither shares the prefix nor the features
    bob = engine.generate([Request(history, max_tokens=5, tenant="bob", images=image)])[0]
    assert bob.cached_tokens == 0 and bob.output_ids == second.output_ids
    assert engine.stats["image_encodes"] == 3


def test_image_refusals_name_the_problem(model):
    image, n = _request_images(model, _images([(8, 8)], seed=1))
    engine = small_engine(model)
    with pytest.raises(ValueError, match="hold 3 image placeholders .* need 4"):
        engine.submit(Request(_prompt(model, [2, ("img", 3)], seed=1), max_tokens=2, images=image))
    with pytest.raises(ValueError, match="hold 4 image placeholders .* no images"):
        engine.submit(Request(_prompt(model, [2, ("img", n)], seed=1), max_tokens=2))
    bad = Images(image.pixel_values, np.array([[2, 2, 2]]))
    with pytest.raises(ValueError, match="t=2"):
        engine.submit(Request(_prompt(model, [2, ("img", n)], seed=1), max_tokens=2, images=bad))
    text_cfg = inference_model_config(load_config("configs/tiny.py").model)
    text = small_engine(create_model(text_cfg, seed=0))
    with pytest.raises(ValueError, match="no vision tower"):
        text.submit(Request((1, 2, 3), max_tokens=2, images=image))
