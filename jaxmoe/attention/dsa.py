"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): a lightning indexer picks, per query, the
top-K past tokens; MLA then attends only to those.

The indexer scores ``I[t, s] = sum_j w[t, j] NI**-0.5 relu(HI**-0.5 q[t, j] . k[s])`` with
``q`` from the MLA q latent (through ``wq_b``), one shared key per token (``wk`` then LayerNorm),
and per-head weights ``w`` from ``x``. Its first R dims are rotated with *non-interleaved* (neox)
RoPE, unlike MLA's interleaved RoPE. Selection is ``top_k`` over causal entries; it carries no
gradient (the reference runs the indexer under ``no_grad``); the indexer is trained by its own KL
loss (``jaxmoe.train.dsa_loss``).

Two paths compute the layer. :meth:`DSA.__call__` runs :func:`jaxmoe.attention.dsa_context.sparse_dsa`:
the indexer scores stream block by block (a bound on each query's K-th score, then the few keys
above it) and each query gathers
only its K selected latents, so no ``[T, S]`` array exists; with a ``context`` mesh axis it runs
context-parallel (keys and latents go round the ring). :meth:`DSA.select` and
:meth:`DSA.sparse_attention` are the dense reference: ``[B, T, S]`` index scores, ``top_k``, a
``[B, T, K, C]`` gather (and the probabilities the indexer's KL loss needs).

Shape letters: B batch, T query length, S key length, K selected keys per query, D model dim,
N heads, H head dim, R rope dim, C kv latent dim, Q q latent dim. Indexer heads are N too in the
einsum strings (``NI`` of them, each ``HI`` wide).

Reference: HF transformers ``DeepseekV32Indexer`` and ``DeepseekV32Attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.attention.dsa_context import DSABlocks, sparse_dsa
from jaxmoe.attention.dsa_topk import index_scores
from jaxmoe.attention.mla import MLA, masked_softmax, softmax_scale
from jaxmoe.config import ModelConfig
from jaxmoe.nn import LayerNorm, apply_rope, dense, param, rope_frequencies
from jaxmoe.nn.linear import normal

_K_NORM_EPS = 1e-6


def gather_keys(values: jax.Array, indices: jax.Array) -> jax.Array:
    """Per-query gather: ``values[B, S, ...]``, ``indices[B, T, K]`` -> ``[B, T, K, ...]``."""
    return jax.vmap(lambda v, i: v[i])(values, indices)


class Indexer(nnx.Module):
    """The lightning indexer: ``wq_b[Q, NI, HI]``, ``wk[D, HI]``, ``k_norm``, ``weights_proj[D, NI]``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        ix = cfg.indexer
        self.cfg = cfg
        D, Q, NI, HI = cfg.d_model, cfg.mla.q_lora_rank, ix.num_heads, ix.head_dim
        init, pdtype = normal(cfg.init_std), jnp.dtype(cfg.param_dtype)
        self.wq_b = param(rngs, (Q, NI, HI), ("q_lora", "heads", "head_dim"), init, pdtype)
        self.wk = param(rngs, (D, HI), ("embed", "head_dim"), init, pdtype)
        self.k_norm = LayerNorm(HI, _K_NORM_EPS, rngs=rngs, param_dtype=pdtype)
        self.weights_proj = param(rngs, (D, NI), ("embed", "heads"), init, pdtype)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotates the first R dims of the last axis (neox layout); the rest pass through."""
        R = self.cfg.mla.qk_rope_head_dim
        inv_freq, attention_factor = rope_frequencies(self.cfg.rope, R)
        rotated = apply_rope(x[..., :R], positions, inv_freq, attention_factor, interleaved=False)
        return jnp.concatenate([rotated, x[..., R:]], axis=-1)

    def query_terms(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotated queries ``q[B, T, NI, HI]`` and head weights ``w[B, T, NI]`` (float32).

        ``w`` carries both scales, ``NI**-0.5`` and ``HI**-0.5`` (relu commutes with a positive
        scale), so scores are ``sum_j w[t, j] relu(q[t, j] . k[s])``.
        """
        NI, HI = self.cfg.indexer.num_heads, self.cfg.indexer.head_dim
        q = self._rope(dense("BTQ,QNH->BTNH", q_latent, self.wq_b), positions)
        w = dense("BTD,DN->BTN", x, self.weights_proj).astype(jnp.float32) * (NI**-0.5 * HI**-0.5)
        return q, w

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotated keys ``k[B, S, HI]``, one per token, shared by the indexer heads."""
        return self._rope(self.k_norm(dense("BSD,DH->BSH", x, self.wk)), positions)

    def __call__(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array) -> jax.Array:
        """Index scores of every query against every key of the same sequence (dense reference).

        Args:
            x: ``[B, T, D]`` the layer input.
            q_latent: ``[B, T, Q]`` the MLA q latent ``q_a_norm(x q_a)``.
            positions: ``[B, T]`` int32 absolute positions (queries and keys alike).

        Returns:
            ``[B, T, S]`` float32 scores (S = T), ``-inf`` at non-causal entries. Differentiable
            with respect to the indexer parameters and the inputs; callers stop gradients.
        """
        with jax.named_scope("indexer"):
            q, w = self.query_terms(x, q_latent, positions)
            return index_scores(q, w, self.keys(x, positions), positions, positions)

    def select(self, scores: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Top ``K = min(topk, S)`` keys per query.

        Args:
            scores: ``[B, T, S]`` from :meth:`__call__` (non-causal entries at ``-inf``).
            positions: ``[B, T]`` int32 positions of the queries, which are also the keys.

        Returns:
            ``indices[B, T, K]`` int32 and ``valid[B, T, K]`` bool. A query with fewer than K
            past tokens gets all of them plus arbitrary future ones marked invalid, as in the
            reference (whose causal mask drops those).
        """
        with jax.named_scope("indexer_topk"):
            K = min(self.cfg.indexer.topk, scores.shape[-1])
            _, indices = jax.lax.top_k(jax.lax.stop_gradient(scores), K)
            key_positions = gather_keys(positions, indices)  # [B, T, K]
            return indices.astype(jnp.int32), key_positions <= positions[:, :, None]


class DSA(MLA):
    """MLA restricted, per query, to the keys its :class:`Indexer` selects (same MLA params)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.mla.q_lora_rank <= 0:
            raise ValueError(
                f"DSA needs model.mla.q_lora_rank > 0 (the indexer reads the q latent), got {cfg.mla.q_lora_rank}"
            )
        super().__init__(cfg, rngs=rngs)
        self.indexer = Indexer(cfg, rngs=rngs)
        self.blocks = DSABlocks()  # block sizes of the streamed path; results do not depend on them
        # True during the indexer's dense warm-up (jaxmoe.train): the layer attends densely, as MLA.
        self.dense_attention = False

    def select(self, x: jax.Array, positions: jax.Array, q_latent: jax.Array | None = None):
        """Runs the indexer on detached inputs: ``(indices[B, T, K], valid[B, T, K])``."""
        q_latent = self.query_latent(x) if q_latent is None else q_latent
        scores = self.indexer(jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent), positions)
        return self.indexer.select(scores, positions)

    def sparse_attention(self, x, positions, indices, valid, q_latent=None) -> tuple[jax.Array, jax.Array]:
        """Attention of each query to its selected keys only, in the absorbed form.

        Args:
            x: ``[B, T, D]``; positions: ``[B, T]``.
            indices, valid: ``[B, T, K]`` from :meth:`select`.
            q_latent: optional precomputed ``[B, T, Q]``.

        Returns:
            ``y[B, T, D]`` and the attention probabilities ``[B, T, N, K]`` (fp32, zero where
            not valid).
        """
        q_latent = self.query_latent(x) if q_latent is None else q_latent
        q_nope, q_rope = self.queries(x, positions, q_latent)
        c_kv, k_rope = self.latents(x, positions)
        latents = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)  # [B, S, C + R]
        return self.attend_selected(q_nope, q_rope, latents, indices, valid)

    def attend_selected(self, q_nope, q_rope, latents, indices, valid) -> tuple[jax.Array, jax.Array]:
        """The absorbed attention of :meth:`sparse_attention` given queries and (cached) latents.

        Args:
            q_nope: ``[B, T, N, Hn]``; q_rope: ``[B, T, N, R]`` from :meth:`queries`.
            latents: ``[B, S, C + R]`` every key position's ``c_kv`` and rope key, concatenated.
            indices, valid: ``[B, T, K]`` the selected key positions (indices into S).

        Returns:
            ``y[B, T, D]`` and the probabilities ``[B, T, N, K]``.
        """
        return self.attend_gathered(q_nope, q_rope, gather_keys(latents, indices), valid)

    def attend_gathered(self, q_nope, q_rope, selected, valid) -> tuple[jax.Array, jax.Array]:
        """:meth:`attend_selected` on the selected latents ``[B, T, K, C + R]`` themselves."""
        with jax.named_scope("sparse_attention"):
            C = self.cfg.mla.kv_lora_rank
            c_sel, r_sel = selected[..., :C], selected[..., C:]
            q_lat = self.absorb_query(q_nope)  # [B, T, N, C]
            logits = jnp.einsum("BTNC,BTKC->BTNK", q_lat, c_sel, preferred_element_type=jnp.float32)
            logits += jnp.einsum("BTNR,BTKR->BTNK", q_rope, r_sel, preferred_element_type=jnp.float32)
            probs = masked_softmax(logits * softmax_scale(self.cfg), valid[:, :, None, :])
            o_lat = jnp.einsum("BTNK,BTKC->BTNC", probs.astype(c_sel.dtype), c_sel)
        return self.output_from_latent(o_lat), probs

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Causal sparse self-attention over ``x[B, T, D]`` at ``positions[B, T]`` -> ``[B, T, D]``.

        Streamed selection and gathered attention (:func:`sparse_dsa`), context-parallel when the
        mesh set with ``jax.set_mesh`` has a ``context`` axis larger than 1 (T must then be a
        multiple of it). Equal to :meth:`select` + :meth:`sparse_attention`. With
        ``dense_attention`` set it is plain (dense causal) MLA and the indexer is not run.
        """
        if self.dense_attention:
            return super().__call__(x, positions)
        with jax.named_scope("dsa"):
            q_index, w_index, q_cat, k_index, latents = self.streamed_operands(x, positions)
            o_latent = sparse_dsa(
                q_index,
                w_index,
                q_cat,
                positions,
                k_index,
                latents,
                positions,
                topk=self.cfg.indexer.topk,
                scale=softmax_scale(self.cfg),
                latent_dim=self.cfg.mla.kv_lora_rank,
                blocks=self.blocks,
            )
            return self.output_from_latent(o_latent)

    def streamed_operands(self, x: jax.Array, positions: jax.Array):
        """The per-token operands of the streamed path (:func:`sparse_dsa`) for ``x[B, T, D]``.

        Returns:
            ``(q_index[B, T, NI, HI], w_index[B, T, NI], q_cat[B, T, N, C+R], k_index[B, T, HI],
            latents[B, T, C+R])``: the indexer's queries, head weights and keys (computed from
            detached inputs: the indexer is trained by its own loss), the absorbed MLA queries
            ``[q_nope kv_b_k, q_rope]`` and the keys' latents ``[c_kv, k_rope]``.
        """
        q_latent = self.query_latent(x)
        q_nope, q_rope = self.queries(x, positions, q_latent)
        q_cat = jnp.concatenate([self.absorb_query(q_nope), q_rope.astype(q_nope.dtype)], axis=-1)
        c_kv, k_rope = self.latents(x, positions)
        latents = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)
        x_i, q_latent_i = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
        with jax.named_scope("indexer"):
            q_index, w_index = self.indexer.query_terms(x_i, q_latent_i, positions)
            k_index = self.indexer.keys(x_i, positions)
        return q_index, w_index, q_cat, k_index, latents
