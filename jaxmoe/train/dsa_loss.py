"""The DSA indexer's training loss (DeepSeek-V3.2 report, section 2.1.1).

The indexer is aligned with the main attention by a KL divergence. For query ``t`` the target
``p[t, :]`` is the main attention probability summed over heads, L1-normalised over keys.

- Dense warm-up (``sparse=False``): ``KL(p[t, :] || softmax(I[t, :]))`` over all causal keys,
  the main attention being dense.
- Sparse stage (``sparse=True``): both distributions live on the selected set ``S_t``: the target
  is the (sparse) main attention over ``S_t`` summed over heads and renormalised over ``S_t``,
  and the indexer distribution is ``softmax(I[t, S_t])``. The main attention in this stage only
  sees ``S_t``, so its probabilities are the ones the model actually used. Everything comes from
  the streamed selection (:func:`jaxmoe.attention.dsa_context.selection_terms`, context-parallel
  under a ``context`` mesh axis): no array has both a query and a key dimension, so the loss
  trains at the lengths the layer runs at. (The warm-up stage is dense by definition.)

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
from jaxmoe.attention.dsa_context import selection_terms
from jaxmoe.attention.mla import causal_mask, softmax_scale


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
        if not sparse:
            q_latent = jax.lax.stop_gradient(module.query_latent(x))
            scores = module.indexer(x, q_latent, positions)  # [B, T, S]
            target = _head_summed_target(module.attention_probs(x, positions))  # [B, T, S]
            kl = kl_to_target(target, scores, causal_mask(positions, positions))
        else:
            q_index, w_index, q_cat, k_index, latents = module.streamed_operands(x, positions)
            probs, scores, valid = selection_terms(
                q_index,
                w_index,
                q_cat,
                positions,
                k_index,
                latents,
                positions,
                topk=module.cfg.indexer.topk,
                scale=softmax_scale(module.cfg),
                blocks=module.blocks,
            )  # each [B, T, K]
            kl = kl_to_target(probs / jnp.sum(probs, axis=-1, keepdims=True), scores, valid)
        return jnp.mean(kl)
