"""Driving the engine's cached forward directly: prefill in chunks, then decode, collecting logits."""

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.inference import Engine, EngineConfig
from jaxmoe.inference.forward import Rows
from jaxmoe.inference.sampler import RowSampling


def inference_model_config(cfg: ModelConfig, **moe) -> ModelConfig:
    """``cfg`` with the dropless dispatch the engine runs (and any other MoE overrides)."""
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **({"dispatch": "dropless"} | moe)))


def _rows(tokens, start, pages, slot, T):
    B = len(tokens)
    tok = np.zeros((B, T), np.int32)
    for b, t in enumerate(tokens):
        tok[b, : len(t)] = t
    length = np.array([len(t) for t in tokens], np.int32)
    return Rows(tok, np.asarray(start, np.int32), length, np.asarray(pages, np.int32), np.asarray(slot, np.int32))


def _greedy_rows(B):
    zeros = np.zeros((B,), np.float32)
    return RowSampling(
        zeros, np.ones((B,), np.float32), np.zeros((B,), np.int32), np.zeros((B,), np.uint32), zeros.astype(np.int32)
    )


def cached_logits(engine: Engine, sequences: list[list[int]], chunks: list[int], decode: int) -> list[np.ndarray]:
    """Logits of every token of every sequence, computed through the pools.

    Each sequence's first ``sum(chunks)`` tokens go in as prefill chunks of the given sizes (all
    sequences in one group, padded), the remaining ``decode`` tokens one at a time as decode rows.
    Sequence ``b`` uses pages ``1 + b * M ..`` and slot ``b``.

    Returns:
      per sequence ``[len, V]`` float32 logits.
    """
    P = engine.config.page_size
    total = sum(chunks) + decode
    M = -(-total // P)
    pages = [[1 + b * M + j for j in range(M)] for b in range(len(sequences))]
    slots = list(range(len(sequences)))
    out = [[] for _ in sequences]
    start = 0
    for c in chunks:
        T = max(8, 1 << (c - 1).bit_length())
        rows = _rows([s[start : start + c] for s in sequences], [start] * len(sequences), pages, slots, T)
        _, _, logits = engine.run_arrays((rows,), _greedy_rows(len(sequences)), all_logits=True)
        for b in range(len(sequences)):
            out[b].append(np.asarray(logits[0][b, :c]))
        start += c
    for _ in range(decode):
        rows = _rows([s[start : start + 1] for s in sequences], [start] * len(sequences), pages, slots, 1)
        _, _, logits = engine.run_arrays((rows,), _greedy_rows(len(sequences)), all_logits=True)
        for b in range(len(sequences)):
            out[b].append(np.asarray(logits[0][b, :1]))
        start += 1
    return [np.concatenate(o, axis=0) for o in out]


def small_engine(model, mesh=None, eos_id=None, detokenize=None, **kw) -> Engine:
    args = dict(cache_bytes=1 << 22, page_size=8, max_seqs=4, snapshot_slots=4, step_tokens=64, chunk_size=16)
    return Engine(model, EngineConfig(**(args | kw)), mesh=mesh, eos_id=eos_id, detokenize=detokenize)


def full_forward(model):
    """``tokens -> logits`` of ``model``'s full forward, jitted with the weights as arguments (not
    baked-in constants), so every model of one config shares a program per token shape."""
    graphdef, state = nnx.split(model)
    return functools.partial(_forward, graphdef, state)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)
