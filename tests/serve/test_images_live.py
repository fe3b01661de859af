"""Images through both APIs, the official SDKs against a live ``jaxmoe serve``, and ``jaxmoe generate --image``.

The server holds the tiny model with a vision tower (configs/tiny.py:vl, random weights) and the
image-text job's tokenizer. Reference: the model's dense forward with the images (one device),
greedy under the same chat-turn constraint (:class:`ChatDecoding`), on scikit-learn's digits.
"""

import base64
import functools
import io
import json
import subprocess
import sys

import anthropic
import httpx2 as httpx
import jax
import numpy as np
import openai
import pytest
from conftest import KEYS, MODEL, start_server, stop_server
from flax import nnx
from PIL import Image

from jaxmoe.chat.decoding import ChatDecoding, MarkupIds
from jaxmoe.chat.template import render
from jaxmoe.checkpoint.io import load_model, save_model
from jaxmoe.model import create_model
from jaxmoe.serve.images import anthropic_image, openai_image
from jaxmoe.vision import captions, image_grids, merged_tokens, vision_inputs
from jaxmoe.vision.preprocess import preprocess
from jaxmoe.vision.train import caption_tokenizer, load_vl_config

QUESTION = "What digit is this?"
MAX_TOKENS = 6
LIMITS = ("--max-images", "2", "--max-image-bytes", "3000", "--max-image-pixels", "4096")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg, vl = load_vl_config("configs/tiny.py:vl")
    path = tmp_path_factory.mktemp("vl_model") / "model"
    save_model(create_model(cfg.model, seed=3), cfg, path)
    caption_tokenizer(vl, cfg.model.vocab_size).save(path)
    return path


@pytest.fixture(scope="module")
def vl_server(checkpoint, tmp_path_factory):
    s = start_server(checkpoint, tmp_path_factory.mktemp("vl_serve"), *LIMITS)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """``(images, messages) -> (answer ids, prompt ids)``: dense greedy under the chat constraint."""
    from jaxmoe.chat.tokenizer import Tokenizer

    cfg, model = load_model(checkpoint)
    tokenizer = Tokenizer.load(checkpoint)
    ids = MarkupIds.from_tokenizer(tokenizer)
    graphdef, state = nnx.split(model)
    vision = cfg.model.vision

    def run(pngs: list[bytes], content_of, constrained: bool = True) -> tuple[list[int], list[int]]:
        pixel_values, grid = preprocess(pngs, vision)
        counts = [merged_tokens([g], vision) for g in image_grids(grid, vision)]
        messages = [{"role": "user", "content": content_of(counts)}]
        prompt = render(messages, tokenizer, thinking=False)
        inputs = vision_inputs(pixel_values, image_grids(grid, vision), vision)
        decoding = ChatDecoding(
            tokenizer, vocab_size=cfg.model.vocab_size, max_tokens=MAX_TOKENS, tool_choice="none", ids=ids
        )
        out = []
        while len(out) < MAX_TOKENS:
            buf = np.zeros((1, 64), np.int32)
            buf[0, : len(prompt) + len(out)] = prompt + out
            logits = np.asarray(_dense(graphdef, state, buf, inputs))[0, len(prompt) + len(out) - 1]
            token = int(np.argmax(np.where(decoding.allowed(), logits, -np.inf) if constrained else logits))
            if constrained:
                decoding.accept(token)
            out.append(token)
            if token in ids.end_ids:
                break
        return out, prompt

    run.tokenizer = tokenizer
    run.end_ids = ids.end_ids
    return run


@functools.partial(jax.jit, static_argnums=0)
def _dense(graphdef, state, tokens, inputs):
    return nnx.merge(graphdef, state)(tokens, images=inputs)


def _digit_png(index: int, scale: int = 1) -> bytes:
    train, _ = captions.load("digits", 0.25, 0)
    image = Image.fromarray(train.images[index])
    if scale != 1:
        image = image.resize((8 * scale, 8 * scale), Image.NEAREST)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _answer_text(reference, tokens):
    return reference.tokenizer.decode([t for t in tokens if t not in reference.end_ids])


def _openai(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[0], max_retries=0, timeout=120)


def _anthropic(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEYS[0], max_retries=0, timeout=120)


def test_openai_image_url_answer_equals_the_dense_reference(vl_server, reference):
    png = _digit_png(0)
    want, prompt = reference([png], lambda n: [{"type": "image", "tokens": n[0]}, {"type": "text", "text": QUESTION}])
    client = _openai(vl_server)
    content = [{"type": "image_url", "image_url": {"url": _data_url(png)}}, {"type": "text", "text": QUESTION}]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        reasoning_effort="none",
    )  # fmt: skip
    assert r.choices[0].message.content == _answer_text(reference, want)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want)
    details = r.usage.prompt_tokens_details
    assert details.image_tokens == 4 and details.text_tokens == len(prompt) - 4  # 8 x 8: 2 x 2 merged patches
    # streamed: the same text
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        reasoning_effort="none", stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == _answer_text(reference, want)
    # the next turn re-sends the image: its prefix (image tokens included) comes from the cache
    history = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "And now?"},
    ]
    again = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=2, temperature=0, reasoning_effort="none"
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 1


def test_anthropic_image_blocks_two_sizes_equal_the_dense_reference(vl_server, reference):
    small, large = _digit_png(1), _digit_png(2, scale=2)  # 4 and 16 image tokens

    def content_of(n):
        return [{"type": "text", "text": "Compare:"}, {"type": "image", "tokens": n[0]},
                {"type": "image", "tokens": n[1]}, {"type": "text", "text": QUESTION}]  # fmt: skip

    want, prompt = reference([small, large], content_of)
    blocks = [
        {"type": "text", "text": "Compare:"},
        _block(small),
        _block(large),
        {"type": "text", "text": QUESTION},
    ]  # fmt: skip
    client = _anthropic(vl_server)
    r = client.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, thinking={"type": "disabled"},
        messages=[{"role": "user", "content": blocks}],
        extra_body={"temperature": 0},  # the SDK no longer takes sampling arguments; the API still does
    )  # fmt: skip
    assert "".join(b.text for b in r.content if b.type == "text") == _answer_text(reference, want)
    assert r.usage.input_tokens == len(prompt)
    count = client.messages.count_tokens(
        model=MODEL, thinking={"type": "disabled"}, messages=[{"role": "user", "content": blocks}]
    )
    assert count.input_tokens == len(prompt)


def _post_openai(server, content):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers(), timeout=60)


def _post_anthropic(server, block):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]}
    return httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEYS[0]}, timeout=60)


def _block(data: bytes, media_type: str = "image/png") -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()},
    }


def _noise_png(side: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://example.com/cat.png", "remote image URLs are refused"),
        ("http://127.0.0.1/x.png", "remote image URLs are refused"),
        ("data:image/png;base64,@@@", "not valid base64"),
        (_data_url(b"not an image at all"), "not a readable image"),
        (_data_url(_digit_png(0), "image/tiff"), "unsupported media type 'image/tiff'"),
        (_data_url(_digit_png(0), "image/jpeg"), "says image/jpeg but the data is PNG"),
        (_data_url(_noise_png(40)), "over the limit of 3000 bytes"),
        ("/tmp/cat.png", "must be a base64 data: URL"),
    ],
)
def test_openai_bad_images_get_400_naming_the_problem(vl_server, url, message):
    r = _post_openai(vl_server, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and "messages[0].content[0]" in error["message"]


def test_anthropic_bad_images_and_limits_get_400(vl_server):
    client = _anthropic(vl_server)
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    with pytest.raises(anthropic.BadRequestError, match="remote image URLs are refused"):
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [url]}])
    data = base64.b64encode(_digit_png(0)).decode()
    for media_type, message in (("image/bmp", "unsupported media type"), ("image/gif", "says image/gif")):
        block = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
        r = _post_anthropic(vl_server, block)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert message in r.json()["error"]["message"]
    big = base64.b64encode(_digit_png(0, scale=9)).decode()  # 72 x 72 pixels > 4096
    r = _post_anthropic(
        vl_server, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": big}}
    )
    assert r.status_code == 400 and "over the limit of 4096" in r.json()["error"]["message"], r.text
    three = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}] * 3
    with pytest.raises(anthropic.BadRequestError, match="3 images; the limit is 2"):
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": three}])


def test_image_parts_parse_without_a_server():
    png = _digit_png(0)
    part = openai_image({"type": "image_url", "image_url": {"url": _data_url(png), "detail": "low"}}, "m[0]")
    assert part.data == png and part.media_type == "image/png"
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()},
    }
    assert anthropic_image(block, "m[0]").data == png
    with pytest.raises(Exception, match="detail: must be auto, low or high"):
        openai_image({"type": "image_url", "image_url": {"url": _data_url(png), "detail": "ultra"}}, "m[0]")


def test_generate_cli_with_an_image_equals_the_reference(checkpoint, reference, tmp_path):
    png = _digit_png(3)
    (tmp_path / "digit.png").write_bytes(png)
    content_of = lambda n: [{"type": "image", "tokens": n[0]}, {"type": "text", "text": QUESTION}]  # noqa: E731
    want, _ = reference([png], content_of, constrained=False)  # generate: no chat constraint
    argv = [sys.executable, "-m", "jaxmoe", "generate", "--checkpoint", str(checkpoint), "--image",
            str(tmp_path / "digit.png"), "--prompt", QUESTION, "--max-new-tokens", str(MAX_TOKENS), "--json",
            "--cache-gb", "0.02", "--page-size", "8"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["image_tokens"] == 4 and result["tokens"] == want
    missing = subprocess.run([*argv[:6], str(tmp_path / "nope.png"), *argv[7:]], capture_output=True, text=True,
                             timeout=600, env=_env())  # fmt: skip
    assert missing.returncode != 0 and "nope.png" in missing.stderr


def _env():
    import os

    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--checkpoint", "x", "--max-images", "0"], "--max-images must be >= 1, got 0"),
        (["serve", "--checkpoint", "x", "--max-image-pixels", "-3"], "--max-image-pixels must be >= 1, got -3"),
        (["generate", "--checkpoint", "x", "--requests", "r.jsonl", "--image", "a.png"], "--image goes with --prompt"),
    ],
)
def test_image_flags_are_checked(argv, message):
    out = subprocess.run(
        [sys.executable, "-m", "jaxmoe", *argv], capture_output=True, text=True, timeout=300, env=_env()
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
