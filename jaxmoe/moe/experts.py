"""Routed-expert computation: the dispatch functions behind ``cfg.moe.dispatch``.

Shapes: N tokens, D model dim, E experts, F expert ffw dim, K experts per token,
A = N*K token-expert assignments.

Every dispatch function has the signature of :data:`Dispatch`: given the tokens, the router's
choice, the stacked expert weights and the MoE config, it returns the weighted sum of the chosen
experts' outputs per token and the routing statistics (:class:`MoEStats`). All four live in
:mod:`jaxmoe.moe.expert_parallel` (``jax.shard_map`` regions): ``"dense"`` keeps every expert on
every device and each device's tokens where they are; ``"dropless"``, ``"capacity"`` and
``"ragged"`` split the experts over the ``expert`` axis.

:func:`grouped_experts` is the same computation as one program: sort assignments by expert and
run each expert's rows as one group of a grouped matmul (:func:`jaxmoe.moe.grouped.grouped_matmul`:
``jax.lax.ragged_dot`` on TPU/GPU, a blocked loop on CPU). Under GSPMD on a mesh the sort makes
XLA gather every token onto every device, which is why the dispatch functions run in
``shard_map`` instead.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import MOE_DISPATCH
from jaxmoe.moe.expert_parallel import MoEStats, capacity_experts, dense_experts, dropless_experts, ragged_experts
from jaxmoe.moe.grouped import grouped_matmul
from jaxmoe.quant.qarray import QArray

# (x_flat [N, D], weights [N, K], indices [N, K], w_gate [E, D, F], w_up [E, D, F],
#  w_down [E, F, D], moe: MoEConfig) -> (y_flat [N, D], MoEStats)
Dispatch = Callable[..., tuple[jax.Array, MoEStats]]


def _grouped_dense(x_sorted: jax.Array, w: jax.Array | nnx.Variable, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul ``[A, I] x [E, I, O] -> [A, O]``; rows of group ``e`` use ``w[e]``.

    Like :func:`jaxmoe.nn.dense`, the weight is cast to the activation's dtype.
    """
    w = w[...] if isinstance(w, nnx.Variable) else w
    w = w if isinstance(w, QArray) else w.astype(x_sorted.dtype)  # MXFP4: dequantized per expert inside
    return grouped_matmul(x_sorted, w, group_sizes, precision=jax.lax.Precision.HIGHEST)


def grouped_experts(
    x_flat: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    w_gate: jax.Array | nnx.Variable,
    w_up: jax.Array | nnx.Variable,
    w_down: jax.Array | nnx.Variable,
) -> jax.Array:
    """Dropless routed experts by sort + grouped matmul (``dispatch == "dense"``).

    Args:
      x_flat: ``[N, D]`` tokens in the compute dtype.
      weights: ``[N, K]`` combine weights.
      indices: ``[N, K]`` int32 chosen experts.
      w_gate, w_up: ``[E, D, F]`` expert weights.
      w_down: ``[E, F, D]`` expert weights.

    Returns:
      ``[N, D]``: ``sum_k weights[n, k] * expert_{indices[n, k]}(x[n])`` in ``x_flat.dtype``.
    """
    N, K = indices.shape
    E = w_gate.shape[0]
    with jax.named_scope("expert_sort"):
        flat_expert = indices.reshape(N * K)  # [A]
        order = jnp.argsort(flat_expert, stable=True)  # [A]: assignment slots grouped by expert
        x_sorted = x_flat[order // K]  # [A, D]
        group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)  # [E]

    with jax.named_scope("expert_ffw"):
        gate = _grouped_dense(x_sorted, w_gate, group_sizes)  # [A, F]
        up = _grouped_dense(x_sorted, w_up, group_sizes)  # [A, F]
        out_sorted = _grouped_dense(jax.nn.silu(gate) * up, w_down, group_sizes)  # [A, D]

    with jax.named_scope("expert_combine"):
        unsort = jnp.argsort(order)  # [A]: inverse permutation
        out = out_sorted[unsort].reshape(N, K, -1)  # [N, K, D]
        # Weight and sum in fp32, the router weights' dtype (HF also weights in fp32).
        out32, weights32 = out.astype(jnp.float32), weights.astype(jnp.float32)
        y = jnp.einsum("NKD,NK->ND", out32, weights32, precision=jax.lax.Precision.HIGHEST)  # [N, D]
    return y.astype(x_flat.dtype)


_DISPATCH: dict[str, Dispatch] = {
    "dense": dense_experts,
    "dropless": dropless_experts,
    "capacity": capacity_experts,
    "ragged": ragged_experts,
}


def get_dispatch(name: str) -> Dispatch:
    """The routed-expert function for ``cfg.moe.dispatch`` (one of ``MOE_DISPATCH``)."""
    if name not in _DISPATCH:
        raise ValueError(f"model.moe.dispatch={name!r} is not one of {MOE_DISPATCH}")
    return _DISPATCH[name]
