"""Model size and memory facts from ``jax.eval_shape`` of the real modules (no weights allocated)."""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.model import abstract_model
from jaxmoe.moe import MoE


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def model_info(cfg: Config) -> dict:
    """Total and activated parameters, layer counts, per-token KV cache and per-sequence state."""
    m = cfg.model
    model = abstract_model(m)
    total = _size(nnx.state(model, nnx.Param))
    # Routed experts a token does not visit are the only parameters it does not activate.
    inactive = 0
    for _, module in nnx.iter_graph(model):
        if isinstance(module, MoE):
            routed = _size([module.w_gate[...], module.w_up[...], module.w_down[...]])
            inactive += routed * (m.moe.num_experts - m.moe.experts_per_token) // m.moe.num_experts

    dtype = jnp.dtype(m.dtype)
    one_token = jax.ShapeDtypeStruct((1, 1, m.d_model), dtype)
    one_pos = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    kv_bytes = state_bytes = 0
    for layer in model.layers:
        if layer.kind in ("mla", "dsa"):
            kv_bytes += _nbytes(jax.eval_shape(layer.attn.cache_entry, one_token, one_pos))
        else:
            state_bytes += _nbytes(jax.eval_shape(lambda a=layer.attn: a.init_state(1, dtype)))
    return {
        "name": cfg.name,
        "total_params": total,
        "active_params": total - inactive,
        "layers": dict(collections.Counter(m.layer_kinds)),
        "kv_cache_bytes_per_token": kv_bytes,
        "state_bytes_per_sequence": state_bytes,
        "max_context": m.max_context,
    }
