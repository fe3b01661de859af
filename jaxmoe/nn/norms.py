"""RMSNorm (computed in fp32, as the references do) and LayerNorm (the DSA indexer's key norm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.nn.linear import ones, param, zeros


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``weight * x / rms(x)`` over the last axis, normalised in fp32 and cast back."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = param(rngs, (dim,), ("norm",), ones, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = param(rngs, (dim,), ("norm",), ones, param_dtype)
        self.bias = param(rngs, (dim,), ("norm",), zeros, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(dtype)
