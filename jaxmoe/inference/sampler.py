"""Next-token sampling for a batch of rows, each with its own parameters.

Greedy (temperature 0), temperature, top-k and top-p (nucleus), with a per-request seed: the
``i``-th token of a request is drawn with ``fold_in(PRNGKey(seed), i)``, so a request gives the
same tokens alone, inside any batch, and after a preemption. Returned log-probabilities are
those of the model's distribution (``log_softmax`` of the raw logits) at the chosen token, what
RL's importance ratios need; an optional boolean mask (grammar-constrained decoding) removes
tokens before anything else.

Shape letters: B rows, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (what ``--requests`` lines and the server pass)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 <= self.seed < 2**32):
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


class RowSampling(NamedTuple):
    """Per-row sampling inputs of one step (padding rows: anything, their tokens are dropped)."""

    temperature: jax.Array  # [B] float32
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    seed: jax.Array  # [B] uint32
    index: jax.Array  # [B] int32: how many tokens the request has generated so far
    mask: jax.Array | None = None  # [B, V] bool: tokens allowed (constrained rows); None: all


def _filtered(logits: jax.Array, temperature, top_p, top_k) -> jax.Array:
    """``logits[V] / temperature`` with everything outside the top-k and the top-p nucleus at -inf."""
    V = logits.shape[-1]
    z = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-z)  # descending; ties lower id first
    ranked = z[order]
    probs = jax.nn.softmax(ranked)
    # Keep a token when the mass strictly before it is below top_p (the first token always stays).
    before = jnp.cumsum(probs) - probs
    keep = (before < top_p) & ((top_k <= 0) | (jnp.arange(V) < top_k)) & jnp.isfinite(ranked)
    keep = keep.at[0].set(True)
    return jnp.full((V,), -jnp.inf, z.dtype).at[order].set(jnp.where(keep, ranked, -jnp.inf))


def _draw(logits: jax.Array, temperature, top_p, top_k, seed, index):
    key = jax.random.fold_in(jax.random.PRNGKey(seed), index)
    sampled = jax.random.categorical(key, _filtered(logits, temperature, top_p, top_k)).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits).astype(jnp.int32))


def sample(logits: jax.Array, rows: RowSampling) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row.

    Args:
      logits: ``[B, V]`` float32.
      rows: the rows' :class:`RowSampling` (``rows.mask``: optional ``[B, V]`` bool, True where a
        token is allowed).

    Returns:
      ``tokens[B]`` int32 and their ``logprobs[B]`` float32 under the (masked) model distribution.
    """
    if rows.mask is not None:
        logits = jnp.where(rows.mask, logits, -jnp.inf)
    greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The sort behind top-p costs more than the rest of a small model's step: only when a row samples.
    draw = lambda: jax.vmap(_draw)(logits, rows.temperature, rows.top_p, rows.top_k, rows.seed, rows.index)
    tokens = jax.lax.cond(jnp.any(rows.temperature > 0), draw, greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
