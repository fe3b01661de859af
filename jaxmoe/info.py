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
from jaxmoe.quant import QArray


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _shape(w) -> tuple[int, ...]:
    return w.shape if isinstance(w, QArray) else w.get_value().shape


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def model_info(cfg: Config) -> dict:
    """Total and activated parameters, layer counts, per-token KV cache and per-sequence state."""
    m = cfg.model
    model = abstract_model(m)
    # MXFP4 weights count by their logical (float) shape, not their packed bytes.
    total = _size(nnx.state(model, nnx.Param)) + sum(
        math.prod(q.shape) for _, q in nnx.iter_graph(model) if isinstance(q, QArray)
    )
    # Routed experts a token does not visit are the only parameters it does not activate.
    inactive = 0
    for _, module in nnx.iter_graph(model):
        if isinstance(module, MoE):
            routed = sum(math.prod(_shape(w)) for w in (module.w_gate, module.w_up, module.w_down))
            inactive += routed * (m.moe.num_experts - m.moe.experts_per_token) // m.moe.num_experts

    dtype = jnp.dtype(m.dtype)
    graphdef, state = nnx.split(model)

    def caches(state):
        """What decoding keeps: per token for mla/dsa layers, per sequence for kda layers."""
        x = jnp.zeros((1, 1, m.d_model), dtype)
        positions = jnp.zeros((1, 1), jnp.int32)
        per_token, per_sequence = [], []
        for layer in nnx.merge(graphdef, state).layers:
            if layer.kind == "kda":
                per_sequence.append(layer.attn.init_state(1))
                continue
            per_token.append(layer.attn.latents(x.astype(dtype), positions))
            if layer.kind == "dsa":  # the indexer's key cache
                per_token.append(jnp.zeros((1, 1, m.indexer.head_dim), dtype))
        return per_token, per_sequence

    per_token, per_sequence = jax.eval_shape(caches, state)
    return {
        "name": cfg.name,
        "total_params": total,
        "active_params": total - inactive,
        "layers": dict(collections.Counter(m.layer_kinds)),
        "kv_cache_bytes_per_token": _nbytes(per_token),
        "state_bytes_per_sequence": _nbytes(per_sequence),
        "max_context": m.max_context,
    }
