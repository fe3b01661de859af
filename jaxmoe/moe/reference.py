"""Slow dense MoE reference: every expert on every token, combined by a one-hot mask.

Shapes: B batch, T sequence, N = B*T tokens, D model dim, E experts, K experts per token,
F expert ffw dim.

Written for clarity, not speed (E full-size expert passes); tests hold the fast dispatch paths
to it, forward and gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.moe.layer import MoE
from jaxmoe.nn import dense


def reference_experts(
    x_flat: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """Dropless routed experts by a loop over experts (the contract of every dispatch's ``y``).

    Args:
      x_flat: ``[N, D]`` tokens; weights: ``[N, K]`` combine weights; indices: ``[N, K]`` chosen
        experts; w_gate, w_up: ``[E, D, F]``; w_down: ``[E, F, D]``.

    Returns:
      ``[N, D]``: ``sum_k weights[n, k] * expert_{indices[n, k]}(x[n])``.
    """
    E = w_gate.shape[0]
    onehot = jax.nn.one_hot(indices, E, dtype=x_flat.dtype)  # [N, K, E]
    combine = jnp.einsum("NKE,NK->NE", onehot, weights.astype(x_flat.dtype))  # [N, E]
    y = jnp.zeros_like(x_flat)  # [N, D]
    for e in range(E):
        h = jax.nn.silu(dense("ND,DF->NF", x_flat, w_gate[e])) * dense("ND,DF->NF", x_flat, w_up[e])
        y = y + combine[:, e, None] * dense("NF,FD->ND", h, w_down[e])
    return y


def reference_moe(moe: MoE, x: jax.Array) -> jax.Array:
    """``moe(x)`` computed densely: ``x [B, T, D] -> y [B, T, D]``."""
    B, T, D = x.shape
    x = x.astype(moe.dtype)
    x_flat = x.reshape(B * T, D)  # [N, D]
    weights, indices, _ = moe.route(x_flat)
    y = reference_experts(x_flat, weights, indices, moe.w_gate[...], moe.w_up[...], moe.w_down[...])
    y = y.reshape(B, T, D)
    if moe.shared is not None:
        y = y + moe.shared(x)
    return y
