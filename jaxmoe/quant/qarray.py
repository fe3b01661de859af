"""A packed MXFP4 weight that stands wherever a float weight stands, and float <-> MXFP4 model states.

Layout. A float weight ``w`` of logical shape ``S`` (input dims first, the jaxmoe convention)
contracts over one axis ``c`` (``QArray.axis``). It is stored with that axis moved last and
quantized there, which is HF gpt-oss's ``*_blocks [..., out, in/32, 16]`` /
``*_scales [..., out, in/32]``: for the routed experts

  ============  ================  ======================  ====================
  weight        logical           ``blocks`` uint8        ``scales`` uint8
  ============  ================  ======================  ====================
  ``w_gate``    ``[E, D, F]``     ``[E, F, D/32, 16]``    ``[E, F, D/32]``
  ``w_up``      ``[E, D, F]``     ``[E, F, D/32, 16]``    ``[E, F, D/32]``
  ``w_down``    ``[E, F, D]``     ``[E, D, F/32, 16]``    ``[E, D, F/32]``
  ============  ================  ======================  ====================

(E experts, D model dim, F expert ffw dim.) In a model state the weight is the subtree
``{"blocks": ..., "scales": ...}`` under the float weight's name, both :class:`MXFP4Param`
variables (not ``nnx.Param``: they are frozen integer data, so gradient and optimizer filters on
``nnx.Param`` skip them). Their logical axes follow the weight's: the contracting axis's name
moves to the ``in/32`` dimension and the 16-byte dimension is unsharded, so an expert-sharded
weight stays sharded over ``expert`` (and ``D/32`` over ``fsdp``, ``F`` over ``tensor``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.quant import mxfp4

# The weights that ``ModelConfig.mxfp4_weights`` may name, and the axis each one contracts over.
MXFP4_CONTRACTING_AXIS = {"w_gate": 1, "w_up": 1, "w_down": 1}
# The routed experts, as gpt-oss quantizes them: the documented choice for an MXFP4 model.
ROUTED_EXPERTS = ("w_gate", "w_up", "w_down")


class MXFP4Param(nnx.Variable):
    """Packed MXFP4 data (``blocks`` or ``scales``) of a weight: uint8, not trained."""


def packed_axes(axes: Sequence[str | None], axis: int) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """Logical axes of ``(blocks, scales)`` for a weight with logical ``axes`` contracting over ``axis``."""
    axes = tuple(axes)
    rest = axes[:axis] + axes[axis + 1 :]
    return (*rest, axes[axis], None), (*rest, axes[axis])


def _moved_shape(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    shape = tuple(shape)
    return shape[:axis] + shape[axis + 1 :] + (shape[axis],)


class QArray(nnx.Pytree):
    """An MXFP4 weight: ``blocks`` uint8 and ``scales`` uint8 (arrays or :class:`MXFP4Param`) + its logical shape.

    Attributes:
      blocks: ``[*S without S[axis], S[axis]/32, 16]`` two E2M1 codes per byte.
      scales: ``[*S without S[axis], S[axis]/32]`` E8M0 exponents (bias 127).
      shape: the float weight's logical shape ``S``.
      axis: the contracting axis of ``S`` that the 32-element blocks run along.
    """

    def __init__(self, blocks, scales, shape: Sequence[int], axis: int):
        shape = tuple(int(s) for s in shape)
        if not 0 <= axis < len(shape):
            raise ValueError(f"QArray axis {axis} is outside the weight shape {shape}")
        want_b, want_s = mxfp4.packed_shapes(_moved_shape(shape, axis))
        got_b, got_s = tuple(blocks.shape), tuple(scales.shape)
        if (got_b, got_s) != (want_b, want_s):
            raise ValueError(
                f"QArray of shape {shape} contracting axis {axis} needs blocks {want_b} and scales {want_s}, "
                f"got {got_b} and {got_s}"
            )
        self.blocks = blocks
        self.scales = scales
        self.shape = shape
        self.axis = int(axis)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def arrays(self) -> tuple[jax.Array, jax.Array]:
        """``(blocks, scales)`` as arrays (unwrapping variables)."""
        b, s = self.blocks, self.scales
        return (b[...] if isinstance(b, nnx.Variable) else b), (s[...] if isinstance(s, nnx.Variable) else s)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight, logical shape ``S``: materialises all of it (fine for one expert, see grouped.py)."""
        blocks, scales = self.arrays()
        w = mxfp4.dequantize(blocks, scales, dtype=dtype)  # [*S without S[axis], S[axis]]
        return jnp.moveaxis(w, -1, self.axis)

    def __repr__(self) -> str:
        return f"QArray(shape={self.shape}, axis={self.axis})"


def quantize_weight(w, axis: int, *, jit: bool = False) -> QArray:
    """Packs the float weight ``w`` contracting over ``axis`` (host :func:`mxfp4.quantize`, or the in-jit kernel)."""
    shape = tuple(w.shape)
    moved = jnp.moveaxis(w, axis, -1)
    blocks, scales = (mxfp4.quantize_jitted if jit else mxfp4.quantize)(moved)
    return QArray(blocks, scales, shape, axis)


def mxfp4_param(
    rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], init, axis: int, *, abstract: bool = False
) -> QArray:
    """A freshly initialised weight (``init`` in float32), quantized; its parts carry derived logical axes."""
    shape = tuple(int(s) for s in shape)
    b_axes, s_axes = packed_axes(axes, axis)
    b_shape, s_shape = mxfp4.packed_shapes(_moved_shape(shape, axis))
    if abstract:
        blocks = jax.ShapeDtypeStruct(b_shape, jnp.uint8)
        scales = jax.ShapeDtypeStruct(s_shape, jnp.uint8)
    else:
        w = init(rngs.params(), shape, jnp.float32)
        blocks, scales = mxfp4.quantize_jitted(jnp.moveaxis(w, axis, -1))
    return QArray(MXFP4Param(blocks, axes=b_axes), MXFP4Param(scales, axes=s_axes), shape, axis)


# --------------------------------------------------------------------------------------------
# Whole model states (pure dicts, as ``nnx.to_pure_dict(nnx.state(model))`` gives them)


def _names(cfg) -> tuple[str, ...]:
    names = tuple(getattr(cfg, "mxfp4_weights", cfg))
    unknown = sorted(set(names) - set(MXFP4_CONTRACTING_AXIS))
    if unknown:
        raise ValueError(f"mxfp4 weights {unknown} are not known; allowed: {sorted(MXFP4_CONTRACTING_AXIS)}")
    return names


def _is_packed(v: Any) -> bool:
    return isinstance(v, Mapping) and set(v) == {"blocks", "scales"}


def quantize_state(params: Mapping, cfg) -> dict:
    """Float model state -> MXFP4 model state for ``cfg``'s quantized weights.

    Args:
      params: nested pure dict (``nnx.to_pure_dict(nnx.state(model))``) of a float model.
      cfg: a ``ModelConfig`` (its ``mxfp4_weights`` name the weights) or a tuple of weight names.

    Returns:
      The same nesting with every float array whose key is one of those names replaced by
      ``{"blocks": uint8, "scales": uint8}`` (layout in the module doc); other entries as given.
      Load it into ``abstract_model(dataclasses.replace(cfg, mxfp4_weights=names))``.

    Raises:
      ValueError: a named weight holds NaN/Inf (the message gives its path) or has a
        contracting dim that is not a multiple of 32.
    """
    names = _names(cfg)

    def walk(d, path):
        out = {}
        for k, v in d.items():
            p = f"{path}/{k}" if path else str(k)
            if isinstance(v, Mapping):
                out[k] = walk(v, p)
            elif k in names:
                try:
                    q = quantize_weight(v, MXFP4_CONTRACTING_AXIS[k])
                except ValueError as e:
                    raise ValueError(f"{p}: {e}") from None
                out[k] = {"blocks": q.blocks, "scales": q.scales}
            else:
                out[k] = v
        return out

    return walk(params, "")


def dequantize_state(params: Mapping, cfg, dtype=None) -> dict:
    """MXFP4 model state -> float model state: the inverse layout of :func:`quantize_state`.

    Args:
      params: nested pure dict where each quantized weight is ``{"blocks", "scales"}`` under its name.
      cfg: a ``ModelConfig`` (``param_dtype`` is the default ``dtype``) or a tuple of weight names.
      dtype: float dtype of the restored weights (default ``cfg.param_dtype``, else float32).

    Returns:
      The same nesting with each packed subtree replaced by its exact float values, logical shape.
    """
    names = _names(cfg)
    dtype = jnp.dtype(dtype or getattr(cfg, "param_dtype", "float32"))

    def walk(d, path):
        out = {}
        for k, v in d.items():
            p = f"{path}/{k}" if path else str(k)
            if _is_packed(v) and k in names:
                b, s = v["blocks"], v["scales"]
                logical_last = b.shape[-2] * mxfp4.BLOCK
                axis = MXFP4_CONTRACTING_AXIS[k]
                shape = tuple(s.shape[:axis]) + (logical_last,) + tuple(s.shape[axis:-1])
                out[k] = QArray(jnp.asarray(b), jnp.asarray(s), shape, axis).dequantize(dtype)
            elif isinstance(v, Mapping):
                out[k] = walk(v, p)
            else:
                out[k] = v
        return out

    return walk(params, "")


def checkpoint_bytes(params: Mapping) -> int:
    """Bytes of every array in a (nested) state: what a checkpoint of it holds before compression."""
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))
