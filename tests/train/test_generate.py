"""``jaxmoe generate`` on the test run: the requested number of tokens, greedy decoding
deterministic and equal to an argmax over the full forward, from the workdir and the MXFP4 export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe import cli
from jaxmoe.train.generate import generate, load_for_generation, sample


@pytest.fixture(scope="module")
def loaded(run):
    return load_for_generation(run.workdir)


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
