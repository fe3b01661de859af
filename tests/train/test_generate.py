"""``jaxmoe generate`` on the test run: the requested number of tokens, greedy decoding through the
engine equal to an argmax over the full forward, from the workdir and the MXFP4 export, and
``--requests`` files (errors naming the line and field)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe import cli
from jaxmoe.inference import Engine, Request, SamplingParams
from jaxmoe.inference.generate import generate, load_for_generation


@pytest.fixture(scope="module")
def loaded(run):
    return load_for_generation(run.workdir)


def sample(model, prompt, *, max_new_tokens, temperature=0.0, seed=0):
    """``max_new_tokens`` ids after ``prompt`` through a small engine (no eos: exactly that many)."""
    engine = Engine(model)
    request = Request(tuple(prompt), max_tokens=max_new_tokens, sampling=SamplingParams(temperature, seed=seed))
    return engine.generate([request])[0].output_ids


def test_greedy_is_the_argmax_of_the_full_forward(loaded):
    cfg, model, tokenizer = loaded
    prompt = [tokenizer.eos_id, *tokenizer.encode("def main():\n    ")]
    ids = sample(model, prompt, max_new_tokens=6, temperature=0.0)
    assert len(ids) == 6 and all(0 <= i < cfg.model.vocab_size for i in ids)
    # Each new token is the argmax at its position of one forward over prompt + tokens (no padding:
    # what follows a position cannot change its logits).
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray([prompt + ids], jnp.int32))[0]
    assert [int(i) for i in jnp.argmax(logits[len(prompt) - 1 : -1], axis=-1)] == ids
    assert sample(model, prompt, max_new_tokens=6, temperature=0.0) == ids


def test_sampling_is_seeded(loaded):
    _, model, tokenizer = loaded
    prompt = [tokenizer.eos_id, *tokenizer.encode("import")]
    a = sample(model, prompt, max_new_tokens=5, temperature=1.0, seed=3)
    assert sample(model, prompt, max_new_tokens=5, temperature=1.0, seed=3) == a
    assert len(a) == 5


def test_generate_from_workdir_and_export(run, capsys):
    out = generate(run.workdir, "class ", max_new_tokens=5)
    assert len(out["tokens"]) == 5 and out["text"] == "class " + out["completion"]
    _, model, tokenizer = load_for_generation(run.workdir)
    assert out["completion"] == tokenizer.decode(out["tokens"])
    export = generate(run.workdir / "export_mxfp4", "class ", max_new_tokens=5)
    assert len(export["tokens"]) == 5
    assert cli.main(["generate", "--checkpoint", str(run.workdir), "--prompt", "class ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == out["text"] + "\n"


def test_workdir_model_is_the_final_checkpoint(run, loaded):
    """The model generate loads holds the last checkpoint's weights, router biases included."""
    from flax import nnx  # noqa: PLC0415

    from jaxmoe.checkpoint.manager import CheckpointManager  # noqa: PLC0415

    _, model, _ = loaded
    state = nnx.to_pure_dict(nnx.state(model))
    with CheckpointManager(run.workdir / "checkpoints") as mgr:
        restored = mgr.restore(6, params=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    jax.tree.map(np.testing.assert_array_equal, state, jax.tree.map(np.asarray, restored.params))
    assert np.any(np.asarray(state["layers"][0]["ffn"]["router_bias"]) != 0)  # the bias was updated and saved


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_requests_file_batched_in_input_order(run, loaded, tmp_path):
    _, model, tokenizer = loaded
    lines = [
        {"prompt": "class ", "max_tokens": 4},
        {
            "prompt_ids": [tokenizer.eos_id, *tokenizer.encode("import os")],
            "max_tokens": 3,
            "temperature": 0.8,
            "seed": 5,
        },
        {"prompt": "def ", "max_tokens": 5, "stop": ["\n"], "ignore_eos": True},
    ]
    _write(tmp_path / "in.jsonl", lines)
    argv = ["generate", "--checkpoint", str(run.workdir), "--requests", str(tmp_path / "in.jsonl")]
    assert cli.main(argv + ["--out", str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [len(o["output_ids"]) <= x["max_tokens"] for o, x in zip(out, lines)] == [True] * 3
    assert out[0]["output_ids"] == sample(model, [tokenizer.eos_id, *tokenizer.encode("class ")], max_new_tokens=4)
    second = sample(model, lines[1]["prompt_ids"], max_new_tokens=3, temperature=0.8, seed=5)
    assert out[1]["output_ids"] == second[: len(out[1]["output_ids"])]
    assert all(o["finish_reason"] in ("stop", "length") and isinstance(o["text"], str) for o in out)
    assert "\n" not in out[2]["text"] and len(out[0]["logprobs"]) == len(out[0]["output_ids"])


@pytest.mark.parametrize(
    "line, message",
    [
        ({"prompt": "x", "max_tokens": "4"}, "'max_tokens' must be an integer"),
        ({"prompt": "x", "temprature": 1.0}, "unknown field 'temprature'"),
        ({"prompt_ids": [1, 2], "prompt": "x"}, "exactly one of 'prompt_ids'"),
        ({"prompt_ids": [1, "a"]}, "'prompt_ids' must be a list of integers"),
        ({"prompt_ids": [1, 2], "top_p": 0}, "top_p must be in"),
        ({"prompt_ids": [1, 99999]}, "prompt_ids must be in"),
        ({"prompt_ids": [1], "max_tokens": 10**6}, "max_context"),
    ],
)
def test_bad_request_lines_are_named(run, tmp_path, capsys, line, message):
    _write(tmp_path / "in.jsonl", [{"prompt": "ok"}, line])
    argv = ["generate", "--checkpoint", str(run.workdir), "--requests", str(tmp_path / "in.jsonl")]
    assert cli.main(argv + ["--out", str(tmp_path / "out.jsonl"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert message in err and ("in.jsonl:2" in err or "request 2" in err), err
