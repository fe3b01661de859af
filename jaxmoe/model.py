"""The hybrid decoder: embedding, a stack of MLA / DSA / KDA + MoE layers, final norm, LM head.

Shape letters: B batch, T sequence, D model dim, V vocab.

Each layer is ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; the attention kind comes from
``cfg.layer_kinds[i]``, the FFN is a dense MLP for the first ``moe.first_k_dense`` layers and the
DeepSeek MoE after. Parameters carry logical axis names; :func:`create_model` builds the model
directly into its sharded layout (no full-size host copy) when given a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.attention.dsa import DSA
from jaxmoe.attention.kda import KDA
from jaxmoe.attention.mla import MLA
from jaxmoe.config import ModelConfig
from jaxmoe.moe import MLP, MoE
from jaxmoe.nn import RMSNorm, dense, param
from jaxmoe.nn.linear import abstract_params, normal
from jaxmoe.sharding import constrain, state_shardings

ATTENTION_MODULES = {"mla": MLA, "dsa": DSA, "kda": KDA}
ACTIVATION_AXES = ("batch", "seq", "act_embed")


def _dtype(name: str):
    return jnp.dtype(name)


class DecoderLayer(nnx.Module):
    """One pre-norm residual block: attention of the given kind, then a dense or MoE FFN."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        self.kind = cfg.layer_kinds[index]
        pdt = _dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
        self.attn = ATTENTION_MODULES[self.kind](cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
        if index < cfg.moe.first_k_dense:
            self.ffn = MLP(cfg.d_model, cfg.moe.dense_ffw_dim, cfg, rngs=rngs)
        else:
            self.ffn = MoE(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        # Under nnx.capture(..., nnx.Intermediate) the layer also sows what the training losses
        # need (jaxmoe.train.step): a DSA layer's attention input (the indexer KL loss) and an MoE
        # layer's router scores and choices (the sequence-wise balance loss). Unused ones are
        # dead code under jit; the router recomputation is the same expression the MoE evaluates.
        capturing = hasattr(self, "__captures__")
        with jax.named_scope(f"attn_{self.kind}"):
            h = self.attn_norm(x)
            if capturing and self.kind == "dsa":
                self.sow(nnx.Intermediate, "attn_input", h)
            x = x + self.attn(h, positions)
        x = constrain(x, ACTIVATION_AXES)
        with jax.named_scope("ffn"):
            h = self.ffn_norm(x)
            if capturing and isinstance(self.ffn, MoE):
                B, T, D = h.shape
                _, indices, scores = self.ffn.route(h.astype(self.ffn.dtype).reshape(B * T, D))
                self.sow(nnx.Intermediate, "router", (scores.reshape(B, T, -1), indices.reshape(B, T, -1)))
            x = x + self.ffn(h)
        return constrain(x, ACTIVATION_AXES)


def _remat_layer(layer: DecoderLayer, x: jax.Array, positions: jax.Array) -> jax.Array:
    """``layer(x, positions)`` under ``jax.checkpoint``: activations recomputed in the backward pass.

    The layer's state goes in and out explicitly, so values it sows (under ``nnx.capture``) survive.
    """
    graphdef, state = nnx.split(layer)

    def call(state, x, positions):
        layer = nnx.merge(graphdef, state)
        y = layer(x, positions)
        return y, nnx.state(layer, nnx.Intermediate)

    y, state = jax.checkpoint(call)(state, x, positions)
    nnx.update(layer, state)
    return y


class Transformer(nnx.Module):
    """Token ids ``[B, T]`` to fp32 logits ``[B, T, V]``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = _dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), normal(cfg.init_std), pdt)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), normal(cfg.init_std), pdt)

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, *, remat: bool = False) -> jax.Array:
        """Final-norm hidden states ``[B, T, D]``.

        With ``remat`` each decoder layer is rematerialised (``jax.checkpoint``): its activations are
        recomputed in the backward pass instead of kept, trading compute for memory.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed_tokens(tokens)  # [B, T, D]
        x = constrain(x, ACTIVATION_AXES)
        call = _remat_layer if remat else DecoderLayer.__call__
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x = call(layer, x, positions)
        return self.final_norm(x)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *, remat: bool = False) -> jax.Array:
        x = self.hidden(tokens, positions, remat=remat)
        return constrain(self.head(x), ("batch", "seq", "vocab"))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``tokens[...]`` -> embeddings ``[..., D]`` in the compute dtype."""
        return jnp.take(self.embed[...], tokens, axis=0).astype(_dtype(self.cfg.dtype))

    def head(self, x: jax.Array) -> jax.Array:
        """Final-norm hidden states ``[..., D]`` -> fp32 logits ``[..., V]``."""
        if self.cfg.tie_embeddings:
            return dense("...D,VD->...V", x, self.embed).astype(jnp.float32)
        return dense("...D,DV->...V", x, self.lm_head).astype(jnp.float32)


def create_model(cfg: ModelConfig, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None) -> Transformer:
    """Builds the model; with a mesh, every parameter is created directly in its sharded layout."""
    if mesh is None:
        return Transformer(cfg, rngs=nnx.Rngs(seed))
    abstract = abstract_model(cfg)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = nnx.to_pure_dict(state_shardings(abstract_state, mesh))

    init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))), out_shardings=shardings)
    state = nnx.state(abstract)
    nnx.replace_by_pure_dict(state, init())
    return nnx.merge(graphdef, state)


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Places an existing (e.g. freshly imported) model's variables onto ``mesh`` by the rules."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    state = jax.device_put(state, shardings)
    return nnx.merge(graphdef, state)


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and dtypes only, no memory."""
    with abstract_params():
        return Transformer(cfg, rngs=nnx.Rngs(0))
