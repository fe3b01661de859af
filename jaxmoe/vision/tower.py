"""MoonViT (Kimi K2.5's vision tower) and its projector into the language model, in Flax NNX.

Shape letters: P patches (all images of a batch), C pixels of a patch (3 x patch x patch),
E vision width, N vision heads, H vision head dim, F MLP width, K patches merged into one token,
M merged tokens, D language-model width.

Per patch: a linear patch embedding (the reference's stride-``patch`` convolution), plus the
learned position table resampled to the image's grid; then pre-norm blocks of bidirectional
attention within each image (2D rotary angles on q and k, interleaved pairs: pair 2j turns with
the patch's column, pair 2j + 1 with its row) and a GELU (tanh) MLP; a final LayerNorm. The
projector LayerNorms each patch, concatenates the K patches of a merge block and maps them with
a 2-layer GELU (erf) MLP to one language-model token.

Weights are stored input-dims first; the ``wqkv`` rows keep the reference checkpoint's order
(q, k, v; per head the interleaved rotary pairs), so an imported checkpoint needs no permutation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import VisionConfig
from jaxmoe.nn import LayerNorm, dense, param
from jaxmoe.nn.linear import normal, zeros
from jaxmoe.vision.layout import VisionInputs


def _linear(rngs, shape, axes, std, dtype):
    """A weight and its bias over the last (output) dim."""
    return param(rngs, shape, axes, normal(std), dtype), param(rngs, shape[-1:], axes[-1:], zeros, dtype)


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [P, N, H]`` with each pair ``(2j, 2j + 1)`` turned by the angle of ``cos, sin [P, H / 2]``."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None], sin[:, None]
    out = jnp.stack([even * c - odd * s, even * s + odd * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, std: float, dtype, *, rngs: nnx.Rngs):
        E, N, H, F = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        self.norm1 = LayerNorm(E, cfg.norm_eps, rngs=rngs, param_dtype=dtype)
        self.norm2 = LayerNorm(E, cfg.norm_eps, rngs=rngs, param_dtype=dtype)
        self.wqkv = param(rngs, (E, 3, N, H), ("embed", None, "heads", "head_dim"), normal(std), dtype)
        self.bqkv = param(rngs, (3, N, H), (None, "heads", "head_dim"), zeros, dtype)
        self.wo, self.bo = _linear(rngs, (N, H, E), ("heads", "head_dim", "embed"), std, dtype)
        self.fc1, self.b1 = _linear(rngs, (E, F), ("embed", "ffw"), std, dtype)
        self.fc2, self.b2 = _linear(rngs, (F, E), ("ffw", "embed"), std, dtype)
        self.scale = H**-0.5

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, same_image: jax.Array) -> jax.Array:
        with jax.named_scope("attention"):
            h = self.norm1(x)
            qkv = dense("PE,EXNH->PXNH", h, self.wqkv) + self.bqkv[...].astype(h.dtype)
            q, k, v = rotate_pairs(qkv[:, 0], cos, sin), rotate_pairs(qkv[:, 1], cos, sin), qkv[:, 2]
            logits = jnp.einsum("PNH,SNH->NPS", q.astype(jnp.float32), k.astype(jnp.float32),
                                precision=jax.lax.Precision.HIGHEST) * self.scale  # fmt: skip
            logits = jnp.where(same_image[None], logits, -jnp.inf)
            weights = jax.nn.softmax(logits, axis=-1)
            o = jnp.einsum("NPS,SNH->PNH", weights, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
            x = x + dense("PNH,NHE->PE", o.astype(x.dtype), self.wo) + self.bo[...].astype(x.dtype)
        with jax.named_scope("mlp"):
            h = dense("PE,EF->PF", self.norm2(x), self.fc1) + self.b1[...].astype(x.dtype)
            h = jax.nn.gelu(h, approximate=True)
            return x + dense("PF,FE->PE", h, self.fc2) + self.b2[...].astype(x.dtype)


class VisionTower(nnx.Module):
    """Patches ``[P, C]`` of one or more images to merged tokens ``[M, D]`` in the language model's width.

    Args:
      cfg: the tower's config.
      d_model: the language model's width D.
      std: initialisation scale of the weights.
      dtype: parameter dtype.
    """

    def __init__(self, cfg: VisionConfig, d_model: int, std: float, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        E, C, KE = cfg.hidden_size, 3 * cfg.patch_size**2, cfg.hidden_size * cfg.merge_size
        self.patch_embed, self.patch_bias = _linear(rngs, (C, E), (None, "embed"), std, dtype)
        self.pos_embed = param(
            rngs, (cfg.pos_emb_height * cfg.pos_emb_width, E), (None, "embed"), normal(std), dtype
        )  # the table, rows in raster order of its grid
        self.blocks = nnx.List([VisionBlock(cfg, std, dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = LayerNorm(E, cfg.norm_eps, rngs=rngs, param_dtype=dtype)
        self.proj_norm = LayerNorm(E, cfg.projection_norm_eps, rngs=rngs, param_dtype=dtype)
        self.proj_in, self.proj_in_bias = _linear(rngs, (KE, KE), ("embed", "ffw"), std, dtype)
        self.proj_out, self.proj_out_bias = _linear(rngs, (KE, d_model), ("ffw", "embed"), std, dtype)

    def encode(self, inputs: VisionInputs) -> jax.Array:
        """The tower's final-norm patch features ``[P, E]`` (before merging), fp32."""
        x = dense("PC,CE->PE", inputs.patches.astype(jnp.float32), self.patch_embed) + self.patch_bias[...]
        with jax.named_scope("position"):
            table = jnp.take(self.pos_embed[...], inputs.pos_index, axis=0)  # [P, 16, E]
            x = x + jnp.einsum("PTE,PT->PE", table, inputs.pos_weight, precision=jax.lax.Precision.HIGHEST)
        same_image = inputs.segment[:, None] == inputs.segment[None, :]  # [P, P]
        for i, block in enumerate(self.blocks):
            with jax.named_scope(f"vision_block_{i}"):
                x = block(x, inputs.cos, inputs.sin, same_image)
        return self.final_norm(x)

    def __call__(self, inputs: VisionInputs) -> jax.Array:
        """Merged tokens ``[M, D]``, fp32, in the order of the images and, within one, row-major."""
        x = self.encode(inputs)
        E, K = self.cfg.hidden_size, self.cfg.merge_size
        with jax.named_scope("projector"):
            x = self.proj_norm(jnp.take(x, inputs.merge_order, axis=0)).reshape(-1, K * E)  # [M, K * E]
            x = jax.nn.gelu(dense("MF,FG->MG", x, self.proj_in) + self.proj_in_bias[...], approximate=False)
            return dense("MG,GD->MD", x, self.proj_out) + self.proj_out_bias[...]
