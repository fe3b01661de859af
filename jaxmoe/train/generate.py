"""Sampling text from a trained model (``jaxmoe generate``).

The model runs on one device over a fixed buffer of ``1 + len(prompt) + max_new_tokens`` tokens
(an eos first, as every training document follows one), recomputing the whole forward for each
new token: one compiled program, and exact, because every layer is causal, so the padding after
the current position cannot change its logits. Routed experts use the dropless local path (a
capacity limit would let padding tokens take capacity). Temperature 0 is greedy decoding.

``--checkpoint`` may be a training workdir (its newest checkpoint and ``tokenizer.json``), a
training checkpoint root (``workdir/checkpoints``), or a model checkpoint such as the MXFP4
export (``config.json`` + ``params/``; the tokenizer beside it or in its parent directory). Each
may be local or in a bucket (``gs://B/P``), which is read in place, never copied to local disk.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.config import Config, MeshConfig
from jaxmoe.data.tokenizer import BPETokenizer
from jaxmoe.errors import CheckpointError
from jaxmoe.model import abstract_model
from jaxmoe.paths import resolve
from jaxmoe.train.checkpoints import CHECKPOINT_DIR, TOKENIZER_FILE, restore_model


def _inference_config(cfg: Config) -> Config:
    moe = dataclasses.replace(cfg.model.moe, dispatch="dropless")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe), mesh=MeshConfig())


def load_for_generation(path: str | pathlib.Path) -> tuple[Config, nnx.Module, BPETokenizer]:
    """``(config, model on one device, tokenizer)`` from a workdir, checkpoint root or model checkpoint."""
    from jaxmoe.checkpoint.io import CONFIG_FILE, load_model  # noqa: PLC0415

    path = resolve(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {str(path)!r} is not a directory")
    if (path / CHECKPOINT_DIR).is_dir():
        cfg, model = restore_model(path / CHECKPOINT_DIR)
    elif (path / CONFIG_FILE).is_file():
        cfg, model = load_model(path)  # read where it lies, a bucket's too
    elif any(p.name.isdigit() for p in path.iterdir()):
        cfg, model = restore_model(path)
    else:
        raise FileNotFoundError(
            f"--checkpoint {str(path)!r} is neither a training workdir (with {CHECKPOINT_DIR}/), a checkpoint "
            f"root (numbered steps) nor a model checkpoint (with {CONFIG_FILE})"
        )
    for where in (path, path.parent):
        if (where / TOKENIZER_FILE).is_file():
            tokenizer = BPETokenizer.load(where / TOKENIZER_FILE)
            break
    else:
        raise FileNotFoundError(
            f"no {TOKENIZER_FILE} in {str(path)!r} or its parent (train writes it into the workdir)"
        )
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise CheckpointError(
            f"{TOKENIZER_FILE} has {tokenizer.vocab_size} tokens, the model's vocab_size is {cfg.model.vocab_size}"
        )
    cfg = _inference_config(cfg)
    return cfg, _with_config(model, cfg), tokenizer


def _with_config(model: nnx.Module, cfg: Config) -> nnx.Module:
    """The same weights in a model built for ``cfg`` (the inference dispatch)."""
    _, state = nnx.split(model)
    graphdef, _ = nnx.split(abstract_model(cfg.model))
    return nnx.merge(graphdef, state)


def _next_token(graphdef, temperature: float, state, tokens, pos, key) -> jax.Array:
    """The token at ``pos`` given ``tokens[1, L]`` (entries from ``pos`` on are ignored: causal)."""
    logits = nnx.merge(graphdef, state)(tokens)[0]  # [L, V]
    row = jax.lax.dynamic_index_in_dim(logits, pos - 1, keepdims=False)  # [V]: predicts position pos
    if temperature == 0:
        return jnp.argmax(row).astype(jnp.int32)
    return jax.random.categorical(key, row / temperature).astype(jnp.int32)


# One compiled program per (model structure, temperature, buffer length), shared by every call.
_next_token_jit = jax.jit(_next_token, static_argnums=(0, 1))


def sample(
    model: nnx.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[int]:
    """``max_new_tokens`` ids continuing ``prompt_ids`` (which should start with eos).

    Greedy when ``temperature == 0``; otherwise sampled from ``softmax(logits / temperature)``
    with keys ``fold_in(PRNGKey(seed), i)`` for the ``i``-th new token.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty (start it with the eos id)")
    if max_new_tokens < 0 or temperature < 0:
        raise ValueError(f"max_new_tokens and temperature must be >= 0, got {max_new_tokens}, {temperature}")
    n = len(prompt_ids)
    buf = np.zeros((1, n + max_new_tokens), np.int32)
    buf[0, :n] = prompt_ids
    graphdef, state = nnx.split(model)
    key = jax.random.PRNGKey(seed)
    for i in range(max_new_tokens):
        token = _next_token_jit(graphdef, float(temperature), state, buf, n + i, jax.random.fold_in(key, i))
        buf[0, n + i] = int(token)
    return buf[0, n:].tolist()


def generate(
    path: str | pathlib.Path, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0
) -> dict:
    """Loads ``path`` and continues ``prompt``: ``{"prompt", "completion", "tokens", "text"}``."""
    cfg, model, tokenizer = load_for_generation(path)
    prompt_ids = [tokenizer.eos_id, *tokenizer.encode(prompt)]
    if len(prompt_ids) + max_new_tokens > cfg.model.max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds model.max_context "
            f"{cfg.model.max_context}"
        )
    ids = sample(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    completion = tokenizer.decode(ids)
    return {"prompt": prompt, "completion": completion, "tokens": ids, "text": prompt + completion}
