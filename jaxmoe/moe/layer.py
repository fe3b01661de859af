"""The FFN blocks: a gated (SwiGLU) MLP and the DeepSeek-style MoE that uses it as shared expert.

Shapes: B batch, T sequence, N = B*T tokens, D model dim, F ffw dim, E experts,
K experts per token.

Sharding: expert weights ``w[E_expert, D_fsdp, F_tensor]``; the router ``[D_fsdp, E]`` and its
bias are replicated over experts so every device can route every token. The block output is
constrained to ``y[B_(data,fsdp,expert), T_context, D]``. ``cfg.moe.dispatch`` picks how routed
tokens reach their experts (:mod:`jaxmoe.moe.experts`, :mod:`jaxmoe.moe.expert_parallel`).

Routing statistics (:class:`MoEStats`: per-expert load, dropped assignments) come from
:meth:`MoE.call_with_stats`, or, for a whole model, by running it under
``nnx.capture(fn, nnx.Intermediate)``: every MoE sows its stats as ``moe_stats``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.moe.expert_parallel import MoEStats
from jaxmoe.moe.experts import get_dispatch
from jaxmoe.moe.router import RouterBias, route
from jaxmoe.nn import dense, param
from jaxmoe.nn.linear import normal, zeros
from jaxmoe.sharding import constrain, token_parallel


class MLP(nnx.Module):
    """``down(silu(gate x) * up x)``: the dense FFN of the first layers, and the shared experts."""

    def __init__(self, d_model: int, ffw_dim: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
        init, pdt = normal(cfg.init_std), jnp.dtype(cfg.param_dtype)
        self.dtype = cfg.dtype
        self.gate = param(rngs, (d_model, ffw_dim), ("embed", "ffw"), init, pdt)  # [D, F]
        self.up = param(rngs, (d_model, ffw_dim), ("embed", "ffw"), init, pdt)  # [D, F]
        self.down = param(rngs, (ffw_dim, d_model), ("ffw", "embed"), init, pdt)  # [F, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., D] -> [..., D]`` in the compute dtype."""
        x = x.astype(self.dtype)
        with jax.named_scope("mlp"):
            h = jax.nn.silu(dense("...D,DF->...F", x, self.gate)) * dense("...D,DF->...F", x, self.up)
            return dense("...F,FD->...D", h, self.down)


class MoE(nnx.Module):
    """Routed experts (sigmoid, bias-corrected, group-limited top-k) plus optional shared experts."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = cfg.moe
        get_dispatch(m.dispatch)  # fail at construction, naming the field, if not available
        D, E, F = cfg.d_model, m.num_experts, m.expert_ffw_dim
        init, pdt = normal(cfg.init_std), jnp.dtype(cfg.param_dtype)
        self.moe = m
        self.dtype = cfg.dtype
        # Routing runs in fp32 whatever the parameter dtype, as in DeepSeek-V3.
        self.router = param(rngs, (D, E), ("embed", None), init, jnp.float32)  # [D, E]
        self.router_bias = param(rngs, (E,), (None,), zeros, jnp.float32, kind=RouterBias)  # [E]
        # Weights named in cfg.mxfp4_weights are stored packed (jaxmoe.quant.QArray), blocks along axis 1.
        q = lambda name: 1 if name in cfg.mxfp4_weights else None
        self.w_gate = param(rngs, (E, D, F), ("experts", "embed", "expert_ffw"), init, pdt, mxfp4_axis=q("w_gate"))
        self.w_up = param(rngs, (E, D, F), ("experts", "embed", "expert_ffw"), init, pdt, mxfp4_axis=q("w_up"))
        self.w_down = param(rngs, (E, F, D), ("experts", "expert_ffw", "embed"), init, pdt, mxfp4_axis=q("w_down"))
        self.shared = MLP(D, F * m.num_shared_experts, cfg, rngs=rngs) if m.num_shared_experts else None

    def route(self, x_flat: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x_flat [N, D]`` -> ``(weights [N, K] fp32, indices [N, K] int32, scores [N, E] fp32)``.

        See :func:`jaxmoe.moe.router.route`. On a mesh each device routes its own tokens
        (:func:`jaxmoe.sharding.token_parallel`): under GSPMD alone ``top_k`` would gather all ``N``.
        """
        fn = lambda x, router, bias: route(x, router, bias, self.moe)
        return token_parallel(fn, (x_flat,), (self.router[...], self.router_bias[...]))

    def call_with_stats(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        """``x [B, T, D] -> (y [B, T, D] in the compute dtype, MoEStats)``: load and drops."""
        B, T, D = x.shape
        x = x.astype(self.dtype)
        with jax.named_scope("moe"):
            x_flat = x.reshape(B * T, D)  # [N, D]
            weights, indices, _ = self.route(x_flat)
            dispatch = get_dispatch(self.moe.dispatch)
            y, stats = dispatch(x_flat, weights, indices, self.w_gate, self.w_up, self.w_down, self.moe)  # [N, D]
            y = y.reshape(B, T, D)
            if self.shared is not None:
                y = y + self.shared(x)
        return constrain(y, ("batch", "seq", "act_embed")), stats

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [B, T, D] -> y [B, T, D]`` in the compute dtype.

        Under ``nnx.capture(..., nnx.Intermediate)`` the call also sows its :class:`MoEStats` as
        ``moe_stats`` (a tuple, one entry per call); outside a capture the module is left as it was.
        """
        y, stats = self.call_with_stats(x)
        # Module.sow outside nnx.capture would add a variable to the module on every call (and warn).
        if hasattr(self, "__captures__"):
            self.sow(nnx.Intermediate, "moe_stats", stats)
        return y
