"""The hybrid decoder: embedding, a stack of MLA / DSA / KDA + MoE layers, final norm, LM head.

Shape letters: B batch, T sequence, D model dim, V vocab.

Each layer is ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; the attention kind comes from
``cfg.layer_kinds[i]``, the FFN is a dense MLP for the first ``moe.first_k_dense`` layers and the
DeepSeek MoE after. Parameters carry logical axis names; :func:`create_model` builds the model
directly into its sharded layout (no full-size host copy) when given a mesh.

Two parameter layouts, the same model: per layer (``layers/i``: checkpoints, HF import, the
inference engine) and, with ``scan=True`` (training), the repeating blocks of
:func:`jaxmoe.layer_plan.plan_layers` stacked on a leading ``layers`` axis and run by
``jax.lax.scan``, so a block is traced and compiled once however often it repeats.
:func:`jaxmoe.layer_plan.stack_layers` / ``unstack_layers`` convert between them; with the same
seed both layouts hold the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.attention.dsa import DSA
from jaxmoe.attention.kda import KDA
from jaxmoe.attention.mla import MLA
from jaxmoe.config import ModelConfig
from jaxmoe.layer_plan import STACK_KEY, Item, layer_signatures, plan_layers, shifted
from jaxmoe.moe import MLP, MoE
from jaxmoe.moe.router import sequence_balance_loss
from jaxmoe.nn import RMSNorm, dense, param
from jaxmoe.nn.linear import abstract_params, normal
from jaxmoe.sharding import constrain, state_shardings
from jaxmoe.train.dsa_loss import indexer_kl_loss
from jaxmoe.vision import VisionInputs, VisionTower

ATTENTION_MODULES = {"mla": MLA, "dsa": DSA, "kda": KDA}
ACTIVATION_AXES = ("batch", "seq", "act_embed")


def _dtype(name: str):
    return jnp.dtype(name)


class DecoderLayer(nnx.Module):
    """One pre-norm residual block: attention of the given kind, then a dense or MoE FFN."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        self.kind, self.index, self.num_experts = cfg.layer_kinds[index], index, cfg.moe.num_experts
        pdt = _dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
        self.attn = ATTENTION_MODULES[self.kind](cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
        if index < cfg.moe.first_k_dense:
            self.ffn = MLP(cfg.d_model, cfg.moe.dense_ffw_dim, cfg, rngs=rngs)
        else:
            self.ffn = MoE(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        # Under nnx.capture(..., nnx.Intermediate) the layer also sows its training losses
        # (jaxmoe.train.step sums them): a DSA layer's indexer KL loss (dense in the warm-up, over
        # the streamed top-K after) and an MoE layer's sequence-wise balance loss. Computed here,
        # inside the layer (and so inside its scan and remat), not from sown activations; unused
        # ones are dead code under jit. The router recomputation is the expression the MoE evaluates.
        capturing = hasattr(self, "__captures__")
        with jax.named_scope(f"attn_{self.kind}"):
            h = self.attn_norm(x)
            if capturing and self.kind == "dsa":
                sparse = not self.attn.dense_attention
                self.sow(nnx.Intermediate, "indexer_kl", indexer_kl_loss(self.attn, h, positions, sparse=sparse))
            x = x + self.attn(h, positions)
        x = constrain(x, ACTIVATION_AXES)
        with jax.named_scope("ffn"):
            h = self.ffn_norm(x)
            if capturing and isinstance(self.ffn, MoE):
                B, T, D = h.shape
                _, indices, scores = self.ffn.route(h.astype(self.ffn.dtype).reshape(B * T, D))
                loss = sequence_balance_loss(scores.reshape(B, T, -1), indices.reshape(B, T, -1), self.num_experts)
                self.sow(nnx.Intermediate, "seq_aux", loss)
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


def _run(node: DecoderLayer | LayerStack, x: jax.Array, positions: jax.Array, remat: bool) -> jax.Array:
    if isinstance(node, LayerStack):
        return node(x, positions, remat=remat)
    return (_remat_layer if remat else DecoderLayer.__call__)(node, x, positions)


def _stacked(variables: tuple[nnx.Variable, ...]) -> nnx.Variable:
    """One variable holding ``variables``' values on a new leading ``layers`` axis."""
    values = [v.get_value() for v in variables]
    if isinstance(values[0], jax.ShapeDtypeStruct):
        value = jax.ShapeDtypeStruct((len(values), *values[0].shape), values[0].dtype)
    else:
        value = jnp.stack(values)
    first = variables[0]
    axes = first.get_metadata().get("axes")
    return first.replace(value, axes=("layers", *axes)) if axes is not None else first.replace(value)


class LayerStack(nnx.Module):
    """``repeats`` back-to-back repetitions of a block of layers, run as one ``jax.lax.scan``.

    ``block`` holds the first repetition's modules with every variable stacked over the
    repetitions (leading axis, logical name ``layers``); nested stacks add one axis each.
    """

    def __init__(self, reps: list[nnx.Dict], first: int, last: int):
        graphdef, state = nnx.split(reps[0])
        states = [nnx.state(r) for r in reps]
        stacked = jax.tree.map(lambda *vs: _stacked(vs), *states, is_leaf=lambda v: isinstance(v, nnx.Variable))
        setattr(self, STACK_KEY, nnx.merge(graphdef, stacked))
        self.first, self.last, self.repeats, self.size = first, last, len(reps), len(reps[0])

    def __call__(self, x: jax.Array, positions: jax.Array, *, remat: bool) -> jax.Array:
        block = getattr(self, STACK_KEY)
        graphdef, state = nnx.split(block)

        def body(x, state):
            block = nnx.merge(graphdef, state)
            for j in range(self.size):
                x = _run(block[str(j)], x, positions, remat)
            # What the layers sowed (under nnx.capture) leaves the scan stacked over repetitions.
            return x, nnx.state(block, nnx.Intermediate)

        with jax.named_scope(f"layers_{self.first}-{self.last}"):
            x, sown = jax.lax.scan(body, x, state)
        nnx.update(block, sown)
        return x


def _build(item: Item, layers: list[DecoderLayer]) -> DecoderLayer | LayerStack:
    if isinstance(item, int):
        return layers[item]
    # String keys: under nnx.capture a container module's state also holds '__captures__', and jax
    # flattens a scan's state by sorted keys.
    reps = [
        nnx.Dict({str(j): _build(shifted(x, r * item.period), layers) for j, x in enumerate(item.block)})
        for r in range(item.repeats)
    ]
    return LayerStack(reps, item.start, item.start + item.repeats * item.period - 1)


def layer_plan(cfg: ModelConfig) -> tuple[Item, ...]:
    """The scanned layout's plan of ``cfg``'s layers (:func:`jaxmoe.layer_plan.plan_layers`)."""
    return plan_layers(layer_signatures(cfg.layer_kinds, cfg.moe.first_k_dense))


class Transformer(nnx.Module):
    """Token ids ``[B, T]`` to fp32 logits ``[B, T, V]``.

    With ``scan`` the layers are held stacked by :func:`layer_plan` (see the module docstring).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, scan: bool = False):
        self.cfg, self.scan = cfg, scan
        pdt = _dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), normal(cfg.init_std), pdt)
        layers = [DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
        self.layers = nnx.List([_build(x, layers) for x in layer_plan(cfg)] if scan else layers)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), normal(cfg.init_std), pdt)
        if cfg.vision is not None:
            self.vision = VisionTower(cfg.vision, cfg.d_model, cfg.init_std, pdt, rngs=rngs)

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        *,
        images: VisionInputs | None = None,
        remat: bool = False,
    ) -> jax.Array:
        """Final-norm hidden states ``[B, T, D]``.

        With ``images`` (a model with a vision tower) the merged image tokens replace the
        ``image_token_id`` placeholders of ``tokens``, in order (row-major over ``[B, T]``); the
        placeholders must number exactly the images' merged tokens (:func:`jaxmoe.vision.merged_tokens`).
        With ``remat`` each decoder layer is rematerialised (``jax.checkpoint``): its activations are
        recomputed in the backward pass instead of kept, trading compute for memory.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed_tokens(tokens)  # [B, T, D]
        if images is not None:
            x = self.place_images(tokens, x, images)
        x = constrain(x, ACTIVATION_AXES)
        for node in self.layers:
            if isinstance(node, LayerStack):
                x = node(x, positions, remat=remat)
            else:
                with jax.named_scope(f"layer_{node.index}"):
                    x = _run(node, x, positions, remat)
        return self.final_norm(x)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        *,
        images: VisionInputs | None = None,
        remat: bool = False,
    ) -> jax.Array:
        x = self.hidden(tokens, positions, images=images, remat=remat)
        return constrain(self.head(x), ("batch", "seq", "vocab"))

    def place_images(self, tokens: jax.Array, x: jax.Array, images: VisionInputs) -> jax.Array:
        """``x [B, T, D]`` with the image placeholders of ``tokens [B, T]`` replaced by the merged tokens."""
        if self.cfg.vision is None:
            raise ValueError("images given to a model without a vision tower (model.vision is not set)")
        features = self.vision(images).astype(x.dtype)  # [M, D]
        placeholder = tokens == self.cfg.vision.image_token_id
        nth = jnp.cumsum(placeholder.reshape(-1)).reshape(tokens.shape) - 1  # which merged token goes where
        picked = jnp.take(features, jnp.clip(nth, 0, features.shape[0] - 1), axis=0)
        return jnp.where(placeholder[..., None], picked, x)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``tokens[...]`` -> embeddings ``[..., D]`` in the compute dtype."""
        return jnp.take(self.embed[...], tokens, axis=0).astype(_dtype(self.cfg.dtype))

    def head(self, x: jax.Array) -> jax.Array:
        """Final-norm hidden states ``[..., D]`` -> fp32 logits ``[..., V]``."""
        if self.cfg.tie_embeddings:
            return dense("...D,VD->...V", x, self.embed).astype(jnp.float32)
        return dense("...D,DV->...V", x, self.lm_head).astype(jnp.float32)


def create_model(
    cfg: ModelConfig, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None, scan: bool = False
) -> Transformer:
    """Builds the model; with a mesh, every parameter is created directly in its sharded layout.

    ``scan`` picks the stacked layout (:class:`Transformer`); the values do not depend on it.
    """
    if mesh is None:
        return Transformer(cfg, rngs=nnx.Rngs(seed), scan=scan)
    abstract = abstract_model(cfg, scan=scan)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = nnx.to_pure_dict(state_shardings(abstract_state, mesh))

    init = jax.jit(
        lambda: nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed), scan=scan))), out_shardings=shardings
    )
    state = nnx.state(abstract)
    nnx.replace_by_pure_dict(state, init())
    return nnx.merge(graphdef, state)


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Places an existing (e.g. freshly imported) model's variables onto ``mesh`` by the rules."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    state = jax.device_put(state, shardings)
    return nnx.merge(graphdef, state)


def abstract_model(cfg: ModelConfig, *, scan: bool = False) -> Transformer:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and dtypes only, no memory."""
    with abstract_params():
        return Transformer(cfg, rngs=nnx.Rngs(0), scan=scan)
