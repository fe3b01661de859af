"""The DSA indexer's training loss (DeepSeek-V3.2 report, section 2.1.1).

The indexer is aligned with the main attention by a KL divergence. For query ``t`` the target
``p[t, :]`` is the main attention probability summed over heads, L1-normalised over keys.

- Dense warm-up (``sparse=False``): ``KL(p[t, :] || softmax(I[t, :]))`` over all causal keys,
  the main attention being dense.
- Sparse stage (``sparse=True``): both distributions live on the selected set ``S_t``: the target
  is the (sparse) main attention over ``S_t`` summed over heads and renormalised over ``S_t``,
  and the indexer distribution is ``softmax(I[t, S_t])``. The main attention in this stage only
  sees ``S_t``, so its probabilities are the ones the model actually used; no dense ``[T, S]``
  attention is computed.

The report sums over tokens; we return the **mean over batch and query tokens** so the scale does
not depend on batch or sequence length. The indexer's inputs (``x`` and the q latent) and the
target are ``stop_gradient``-ed, so the loss trains only the indexer's parameters and the main
model is trained by the language-modelling loss alone.

Shape letters: B batch, T queries, S keys, K selected keys, N heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.attention.dsa import DSA
from jaxmoe.attention.mla import causal_mask


def kl_to_target(target: jax.Array, scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-query ``KL(target || softmax(scores))`` over the entries where ``mask`` holds.

    Args:
        target: ``[..., S]`` probabilities summing to 1 over the masked-in entries (0 elsewhere).
        scores: ``[..., S]`` logits of the other distribution.
        mask: ``[..., S]`` bool, at least one entry true per row.

    Returns:
        ``[...]`` float32 KL divergences (>= 0).
    """
    target = target.astype(jnp.float32)
    log_q = jax.nn.log_softmax(jnp.where(mask, scores.astype(jnp.float32), -jnp.inf), axis=-1)
    log_q = jnp.where(mask, log_q, 0.0)
    positive = mask & (target > 0)
    log_p = jnp.log(jnp.where(positive, target, 1.0))
    return jnp.sum(jnp.where(positive, target * (log_p - log_q), 0.0), axis=-1)


def _head_summed_target(probs: jax.Array) -> jax.Array:
    """Attention ``probs[B, T, N, S]`` -> head-summed, L1-normalised ``[B, T, S]`` (no gradient)."""
    p = jnp.sum(jax.lax.stop_gradient(probs).astype(jnp.float32), axis=2)
    return p / jnp.sum(p, axis=-1, keepdims=True)


def indexer_kl_loss(module: DSA, x: jax.Array, positions: jax.Array, *, sparse: bool) -> jax.Array:
    """The indexer KL loss of one DSA layer, a float32 scalar (mean over batch and queries).

    Args:
        module: the DSA layer.
        x: ``[B, T, D]`` the layer's attention input (after the pre-attention norm).
        positions: ``[B, T]`` int32 absolute positions.
        sparse: False for the dense warm-up stage, True for the sparse stage.
    """
    with jax.named_scope("indexer_kl_loss"):
        x = jax.lax.stop_gradient(x)
        q_latent = jax.lax.stop_gradient(module.query_latent(x))
        scores = module.indexer(x, q_latent, positions)  # [B, T, S]
        if not sparse:
            target = _head_summed_target(module.attention_probs(x, positions))  # [B, T, S]
            kl = kl_to_target(target, scores, causal_mask(positions, positions))
        else:
            indices, valid = module.indexer.select(scores, positions)  # [B, T, K]
            _, probs = module.sparse_attention(x, positions, indices, valid, q_latent)  # [B, T, N, K]
            target = _head_summed_target(probs)
            selected = jnp.take_along_axis(scores, indices, axis=-1)  # [B, T, K]
            kl = kl_to_target(target, selected, valid)
        return jnp.mean(kl)
