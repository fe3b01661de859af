"""Parameter creation with logical axes, and the one contraction every weight goes through.

Weights are stored input-dims first (``[D, N, H]`` for a projection to heads), the JAX
convention; the HF importer transposes torch's ``[out, in]``. Every weight matmul goes through
:func:`dense`, so a packed MXFP4 weight (:class:`jaxmoe.quant.QArray`, made by :func:`param`
with ``mxfp4_axis``) stands wherever a float weight stands.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.quant.qarray import QArray, mxfp4_param

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
    mxfp4_axis: int | None = None,
) -> nnx.Variable | QArray:
    """A variable of ``shape`` whose dimensions carry the logical names ``axes``.

    With ``mxfp4_axis`` (the dimension the weight contracts over) the weight is initialised in
    float32 and stored packed as a :class:`jaxmoe.quant.QArray` (``dtype`` is then unused).
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {tuple(axes)} differ in rank")
    if mxfp4_axis is not None:
        return mxfp4_param(rngs, shape, axes, init, mxfp4_axis, abstract=_ABSTRACT.get())
    if _ABSTRACT.get():
        return kind(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), axes=tuple(axes))
    return kind(init(rngs.params(), shape, dtype), axes=tuple(axes))


def dense(eq: str, x: jax.Array, w: jax.Array | nnx.Variable | QArray, dtype=None) -> jax.Array:
    """``jnp.einsum(eq, x, w)`` with the weight cast to the activation's (or ``dtype``) dtype.

    A :class:`jaxmoe.quant.QArray` weight is dequantized (exactly) to that dtype inside the
    computation; its packed form is what is stored and moved.
    """
    dtype = dtype or x.dtype
    if isinstance(w, QArray):
        w = w.dequantize(dtype)
    w = w[...] if isinstance(w, nnx.Variable) else w
    return jnp.einsum(eq, x.astype(dtype), w.astype(dtype), precision=jax.lax.Precision.HIGHEST)
