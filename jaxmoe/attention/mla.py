"""Multi-head latent attention (MLA), DeepSeek-V2/V3 style; NoPE variant for Kimi Linear.

Every token is compressed to a shared latent ``c_kv[C]`` (RMS-normalised) plus one shared rope
key ``k_rope[R]``; per-head keys and values are up-projections of the latent through ``kv_b``.
Two equivalent ways to attend:

- *expanded* (MHA, training and prefill): ``k = [c_kv kv_b_k, k_rope]``, ``v = c_kv kv_b_v``.
- *absorbed* (MQA over the latent, decode): ``kv_b_k`` is folded into the query and ``kv_b_v``
  into the output, so queries attend to cached latents directly and no per-head K/V is built.

Shape letters: B batch, T query length, S key length, D model dim, N heads, H per-head dim
(nope or value), R rope dim, C kv latent dim, Q q latent dim.

Reference: HF transformers ``DeepseekV3Attention`` (interleaved RoPE) and ``KimiLinearAttention``
(NoPE, no low-rank q).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.attention.blockwise import blockwise_attention
from jaxmoe.attention.context_parallel import context_parallel_size, from_zigzag, to_zigzag
from jaxmoe.attention.mla_context import ring_mla_attention
from jaxmoe.config import ModelConfig
from jaxmoe.nn import RMSNorm, apply_rope, dense, param, rope_frequencies, yarn_mscale
from jaxmoe.nn.linear import normal

_LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm / kv_a_layernorm use their default eps


def causal_mask(q_positions: jax.Array, kv_positions: jax.Array) -> jax.Array:
    """``[B, T, S]`` bool: key ``s`` is visible to query ``t`` when ``kv_pos[s] <= q_pos[t]``."""
    return kv_positions[:, None, :] <= q_positions[:, :, None]


def masked_softmax(logits: jax.Array, mask: jax.Array, axis: int = -1) -> jax.Array:
    """fp32 softmax over ``axis`` (the last by default) with masked entries at exactly zero probability.

    A fully masked row gives all zeros rather than NaN (padding in a cache can produce one).
    """
    logits = jnp.where(mask, logits.astype(jnp.float32), -jnp.inf)
    row_max = jnp.max(logits, axis=axis, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(mask, jnp.exp(logits - jax.lax.stop_gradient(row_max)), 0.0)
    denom = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(denom > 0, denom, 1.0)


def softmax_scale(cfg: ModelConfig) -> float:
    """``qk_head_dim**-0.5``, times YaRN's ``mscale(factor, mscale_all_dim)**2`` (HF yarn_apply_mscale)."""
    scale = cfg.mla.qk_head_dim**-0.5
    r = cfg.rope
    if cfg.mla.use_rope and r.type == "yarn" and r.mscale_all_dim:
        scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return scale


class MLA(nnx.Module):
    """Causal multi-head latent attention.

    Parameters are stored input-dims first: ``q_a[D, Q]``, ``q_a_norm``, ``q_b[Q, N, Hn+R]`` (or
    ``q[D, N, Hn+R]`` without low-rank q), ``kv_a[D, C+R]``, ``kv_a_norm``, ``kv_b[C, N, Hn+Hv]``,
    ``o[N, Hv, D]``. Per head the query is laid out ``[nope, rope]`` and ``kv_b`` as ``[k_nope, v]``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = cfg.mla
        self.cfg = cfg
        D, N, C, R, Q = cfg.d_model, m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.q_lora_rank
        init, pdtype = normal(cfg.init_std), jnp.dtype(cfg.param_dtype)
        if Q > 0:
            self.q_a = param(rngs, (D, Q), ("embed", "q_latent"), init, pdtype)
            self.q_a_norm = RMSNorm(Q, _LATENT_NORM_EPS, rngs=rngs, param_dtype=pdtype)
            self.q_b = param(rngs, (Q, N, m.qk_head_dim), ("q_lora", "heads", "head_dim"), init, pdtype)
        else:
            self.q = param(rngs, (D, N, m.qk_head_dim), ("embed", "heads", "head_dim"), init, pdtype)
        self.kv_a = param(rngs, (D, C + R), ("embed", "kv_latent"), init, pdtype)
        self.kv_a_norm = RMSNorm(C, _LATENT_NORM_EPS, rngs=rngs, param_dtype=pdtype)
        self.kv_b = param(
            rngs, (C, N, m.qk_nope_head_dim + m.v_head_dim), ("kv_lora", "heads", "head_dim"), init, pdtype
        )
        self.o = param(rngs, (N, m.v_head_dim, D), ("heads", "head_dim", "embed"), init, pdtype)

    # ----------------------------------------------------------------------------------------
    # Projections

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        if not self.cfg.mla.use_rope:
            return x
        inv_freq, attention_factor = rope_frequencies(self.cfg.rope, self.cfg.mla.qk_rope_head_dim)
        return apply_rope(x, positions, inv_freq, attention_factor, interleaved=True)

    def query_latent(self, x: jax.Array) -> jax.Array:
        """``q_a_norm(x q_a)``: ``[B, T, Q]``, the q latent (also read by the DSA indexer)."""
        if self.cfg.mla.q_lora_rank <= 0:
            raise ValueError("query_latent needs model.mla.q_lora_rank > 0")
        return self.q_a_norm(dense("BTD,DQ->BTQ", x, self.q_a))

    def queries(
        self, x: jax.Array, positions: jax.Array, q_latent: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Per-head queries: ``q_nope[B, T, N, Hn]`` and rotated ``q_rope[B, T, N, R]``.

        ``q_latent`` may be passed when the caller already computed it (DSA shares it).
        """
        with jax.named_scope("queries"):
            if self.cfg.mla.q_lora_rank > 0:
                q_latent = self.query_latent(x) if q_latent is None else q_latent
                q = dense("BTQ,QNH->BTNH", q_latent, self.q_b)
            else:
                q = dense("BTD,DNH->BTNH", x, self.q)
            Hn = self.cfg.mla.qk_nope_head_dim
            return q[..., :Hn], self._rope(q[..., Hn:], positions)

    def latents(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What a KV cache stores per token: normalised ``c_kv[B, S, C]`` and rotated ``k_rope[B, S, R]``."""
        with jax.named_scope("kv_latents"):
            C = self.cfg.mla.kv_lora_rank
            kv = dense("BSD,DC->BSC", x, self.kv_a)  # [B, S, C + R]
            return self.kv_a_norm(kv[..., :C]), self._rope(kv[..., C:], positions)

    def _kv_b_k(self) -> jax.Array:
        return self.kv_b[...][..., : self.cfg.mla.qk_nope_head_dim]  # [C, N, Hn]

    def _kv_b_v(self) -> jax.Array:
        return self.kv_b[...][..., self.cfg.mla.qk_nope_head_dim :]  # [C, N, Hv]

    def expand_kv(self, c_kv: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-head ``k_nope[B, S, N, Hn]`` and ``v[B, S, N, Hv]`` from the latent (expanded form)."""
        kv = dense("BSC,CNH->BSNH", c_kv, self.kv_b)  # [B, S, N, Hn + Hv]
        Hn = self.cfg.mla.qk_nope_head_dim
        return kv[..., :Hn], kv[..., Hn:]

    def absorb_query(self, q_nope: jax.Array) -> jax.Array:
        """``q_nope[B, T, N, Hn]`` -> ``[B, T, N, C]``: the nope query expressed in latent space."""
        return dense("BTNH,CNH->BTNC", q_nope, self._kv_b_k())

    def output_from_latent(self, o_latent: jax.Array) -> jax.Array:
        """Attention output in latent space ``[B, T, N, C]`` -> ``y[B, T, D]`` (absorbed ``kv_b_v``)."""
        with jax.named_scope("out_proj"):
            out = dense("BTNC,CNH->BTNH", o_latent, self._kv_b_v())
            return dense("BTNH,NHD->BTD", out, self.o)

    # ----------------------------------------------------------------------------------------
    # Attention

    def attention_probs(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Dense causal attention probabilities ``[B, T, N, S]`` (fp32), expanded form."""
        probs, _ = self._expanded(x, positions)
        return probs

    def _expanded(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        q_nope, q_rope = self.queries(x, positions)
        c_kv, k_rope = self.latents(x, positions)
        with jax.named_scope("attention"):
            k_nope, v = self.expand_kv(c_kv)
            logits = jnp.einsum("BTNH,BSNH->BTNS", q_nope, k_nope, preferred_element_type=jnp.float32)
            logits += jnp.einsum("BTNR,BSR->BTNS", q_rope, k_rope, preferred_element_type=jnp.float32)
            mask = causal_mask(positions, positions)[:, :, None, :]  # [B, T, 1, S]
            probs = masked_softmax(logits * softmax_scale(self.cfg), mask)
            out = jnp.einsum("BTNS,BSNH->BTNH", probs.astype(v.dtype), v)
        return probs, out

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Causal self-attention over ``x[B, T, D]`` at absolute ``positions[B, T]`` -> ``[B, T, D]``.

        Expanded (per-head K/V) form, computed block by block with an online softmax
        (:func:`blockwise_attention`); :meth:`attention_probs` is the dense form of the same.
        With a mesh whose ``context`` axis has size P > 1 this is ring attention
        (:meth:`context_parallel`); T must then be a multiple of 2P.
        """
        if context_parallel_size() > 1:
            return self.context_parallel(x, positions)
        with jax.named_scope("mla"):
            q_nope, q_rope = self.queries(x, positions)
            c_kv, k_rope = self.latents(x, positions)
            k_nope, v = self.expand_kv(c_kv)
            B, S, N, _ = k_nope.shape
            q = jnp.concatenate([q_nope, q_rope], axis=-1)  # [B, T, N, Hn + R]
            k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (B, S, N, k_rope.shape[-1]))  # shared by heads
            k = jnp.concatenate([k_nope, k_rope], axis=-1)  # [B, S, N, Hn + R]
            out = blockwise_attention(q, k, v, positions, positions, softmax_scale(self.cfg))
            with jax.named_scope("out_proj"):
                return dense("BTNH,NHD->BTD", out, self.o)

    def context_parallel(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """:meth:`__call__` for ``x[B, T_context, D]``: ring attention over the ``context`` axis.

        Tokens move to the zig-zag layout (balanced causal work) for the attention and back, so
        the caller's layout stays contiguous; the kv latents, not per-head K/V, circulate.
        """
        with jax.named_scope("mla_ring"):
            x, positions = to_zigzag(x), to_zigzag(positions)
            q_nope, q_rope = self.queries(x, positions)
            c_kv, k_rope = self.latents(x, positions)
            q = jnp.concatenate([q_nope, q_rope], axis=-1)  # [B, T, N, Hn + R]
            out = ring_mla_attention(
                q,
                c_kv,
                k_rope,
                self.kv_b[...],
                positions,
                positions,
                softmax_scale(self.cfg),
                nope_dim=self.cfg.mla.qk_nope_head_dim,
            )
            with jax.named_scope("out_proj"):
                y = dense("BTNH,NHD->BTD", out, self.o)
            return from_zigzag(y)

    def attend_latent(
        self,
        x: jax.Array,
        positions: jax.Array,
        c_kv: jax.Array,
        k_rope: jax.Array,
        kv_positions: jax.Array,
    ) -> jax.Array:
        """Absorbed (MQA-over-latent) attention of new tokens to cached latents.

        Args:
            x: ``[B, T, D]`` the query tokens.
            positions: ``[B, T]`` int32 absolute positions of the queries.
            c_kv: ``[B, S, C]`` cached normalised latents (from :meth:`latents`; include the
                query tokens' own entries for self-attention).
            k_rope: ``[B, S, R]`` cached rotated rope keys.
            kv_positions: ``[B, S]`` int32 positions of the cache entries; an entry is visible
                to a query when ``kv_pos <= q_pos``.

        Returns:
            ``[B, T, D]``, equal to the expanded form on the same keys.
        """
        with jax.named_scope("mla_absorbed"):
            q_nope, q_rope = self.queries(x, positions)
            with jax.named_scope("attention"):
                q_lat = self.absorb_query(q_nope)  # [B, T, N, C]
                logits = jnp.einsum("BTNC,BSC->BTNS", q_lat, c_kv, preferred_element_type=jnp.float32)
                logits += jnp.einsum("BTNR,BSR->BTNS", q_rope, k_rope, preferred_element_type=jnp.float32)
                mask = causal_mask(positions, kv_positions)[:, :, None, :]  # [B, T, 1, S]
                probs = masked_softmax(logits * softmax_scale(self.cfg), mask)
                o_lat = jnp.einsum("BTNS,BSC->BTNC", probs.astype(c_kv.dtype), c_kv)
            return self.output_from_latent(o_lat)
