"""Parameter creation with logical axes, and the one contraction every weight goes through.

Weights are stored input-dims first (``[D, N, H]`` for a projection to heads), the JAX
convention; the HF importer transposes torch's ``[out, in]``. Every weight matmul goes through
:func:`dense` so a later quantized weight type can stand wherever a float weight stands.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal(std: float) -> Init:
    return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


_ABSTRACT = contextvars.ContextVar("jaxmoe_abstract_params", default=False)


@contextlib.contextmanager
def abstract_params() -> Iterator[None]:
    """Within this context :func:`param` makes ``jax.ShapeDtypeStruct`` values: no memory, no tracing.

    Equivalent to ``nnx.eval_shape`` of a constructor, but linear in model size (tracing a
    96-layer constructor under ``eval_shape`` takes minutes: each RNG-counter update inspects
    the growing trace).
    """
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    axes: Sequence[str | None],
    init: Init,
    dtype=jnp.float32,
    kind: type[nnx.Variable] = nnx.Param,
) -> nnx.Variable:
    """A variable of ``shape`` whose dimensions carry the logical names ``axes``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {tuple(axes)} differ in rank")
    if _ABSTRACT.get():
        return kind(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), axes=tuple(axes))
    return kind(init(rngs.params(), shape, dtype), axes=tuple(axes))


def dense(eq: str, x: jax.Array, w: jax.Array | nnx.Variable, dtype=None) -> jax.Array:
    """``jnp.einsum(eq, x, w)`` with the weight cast to the activation's (or ``dtype``) dtype."""
    w = w[...] if isinstance(w, nnx.Variable) else w
    dtype = dtype or x.dtype
    return jnp.einsum(eq, x.astype(dtype), w.astype(dtype), precision=jax.lax.Precision.HIGHEST)
