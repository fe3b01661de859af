"""DeepSeek-V3 router: sigmoid scores, aux-loss-free selection bias, group-limited top-k.

Shapes: N tokens (batch x sequence, flattened), D model dim, E experts, G expert groups,
K experts per token.

The correction bias steers *which* experts are chosen (so load can be balanced without an
auxiliary loss) but never *how much* they contribute: weights are gathered from the unbiased
sigmoid scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import MoEConfig
from jaxmoe.nn import dense


class RouterBias(nnx.Variable):
    """Per-expert selection bias ``[E]`` (fp32); not trained by the optimizer, updated from load."""


def route(
    x_flat: jax.Array, router: jax.Array, bias: jax.Array, moe: MoEConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chooses ``K`` experts per token and their combine weights.

    Args:
      x_flat: ``[N, D]`` tokens, any float dtype (the logits are computed in fp32).
      router: ``[D, E]`` router weight.
      bias: ``[E]`` fp32 selection bias (enters the choice only).
      moe: the MoE config (experts, groups, top-k, normalisation, scaling).

    Returns:
      weights: ``[N, K]`` fp32 combine weights (normalised if ``norm_topk_prob``, then scaled by
        ``routed_scaling_factor``).
      indices: ``[N, K]`` int32 chosen experts (in top-k order of the biased scores).
      scores: ``[N, E]`` fp32 unbiased sigmoid scores.
    """
    N = x_flat.shape[0]
    E, G, K = moe.num_experts, moe.num_groups, moe.experts_per_token
    with jax.named_scope("router_logits"):
        logits = dense("ND,DE->NE", x_flat, router, dtype=jnp.float32)  # [N, E]
        scores = jax.nn.sigmoid(logits)

    with jax.named_scope("router_select"):
        # Selection is discrete: no gradient flows through the biased scores.
        choice = jax.lax.stop_gradient(scores) + bias.astype(jnp.float32)[None, :]  # [N, E]
        if moe.topk_groups < G:
            grouped = choice.reshape(N, G, E // G)  # [N, G, E/G]
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [N, G]
            _, group_idx = jax.lax.top_k(group_scores, moe.topk_groups)  # [N, topk_groups]
            keep_group = jnp.any(group_idx[:, :, None] == jnp.arange(G)[None, None, :], axis=1)  # [N, G]
            keep = jnp.repeat(keep_group, E // G, axis=-1)  # [N, E]
            choice = jnp.where(keep, choice, -jnp.inf)
        _, indices = jax.lax.top_k(choice, K)  # [N, K]

    with jax.named_scope("router_weights"):
        weights = jnp.take_along_axis(scores, indices, axis=-1)  # [N, K]
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        weights = weights * moe.routed_scaling_factor
    return weights, indices.astype(jnp.int32), scores


def sequence_balance_loss(scores: jax.Array, indices: jax.Array, num_experts: int) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss of one MoE layer (eqs. 17-20), before its weight.

    ``L = mean_b sum_e f[b, e] P[b, e]`` with ``f = E / (K T) * #{t : e in top-k(t)}`` (no
    gradient) and ``P = mean_t s'[b, t, e]``, ``s'`` the sigmoid scores normalised over experts.

    Args:
        scores: ``[B, T, E]`` fp32 unbiased sigmoid router scores.
        indices: ``[B, T, K]`` int32 chosen experts.
        num_experts: E.
    """
    T, K = indices.shape[1], indices.shape[2]
    chosen = jnp.sum(jax.nn.one_hot(indices, num_experts, dtype=jnp.float32), axis=2)  # [B, T, E]
    f = jax.lax.stop_gradient(jnp.sum(chosen, axis=1) * (num_experts / (K * T)))  # [B, E]
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)  # [B, E]
    return jnp.mean(jnp.sum(f * p, axis=-1))
