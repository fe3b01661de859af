"""Rotary position embedding with YaRN frequency scaling (DeepSeek-V3 style).

Two layouts: *interleaved* pairs ``(x0, x1), (x2, x3), ...`` (MLA, DeepSeek's checkpoints) and
*half-split* ``(x_i, x_{i+R/2})`` (the neox layout, used by the DSA indexer). Interleaved output
is written de-interleaved (evens then odds), exactly as the reference does, so that q and k agree.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[dim/2]`` (float32) and the factor applied to cos and sin."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.float32(cfg.theta) ** exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if cfg.type == "default":
        return inv_freq, 1.0
    factor = cfg.factor
    if cfg.mscale and cfg.mscale_all_dim:
        attention_factor = yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(cfg.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1) - ramp
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def _cos_sin(positions: jax.Array, inv_freq: np.ndarray, attention_factor: float):
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., R/2]
    return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: np.ndarray,
    attention_factor: float = 1.0,
    *,
    interleaved: bool,
) -> jax.Array:
    """Rotates the last axis of ``x[B, T, ..., R]`` by ``positions[B, T]``.

    Interleaved input pairs ``(x[2i], x[2i+1])``; the output is laid out as
    ``[rotated evens, rotated odds]``, matching HF ``apply_rotary_pos_emb_interleave``.
    """
    cos, sin = _cos_sin(positions, inv_freq, attention_factor)  # [B, T, R/2]
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:]).astype(x.dtype)
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:]).astype(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
