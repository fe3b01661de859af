"""Shared helpers for reading HF (torch-layout) tensors into jaxmoe modules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

# CheckpointError lives in jaxmoe.errors; importing it from here still works (tests and scripts do).
from jaxmoe.errors import CheckpointError


def take(tensors: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    """``tensors[key]`` as a float32 numpy array, with a clear error if it is missing."""
    if key not in tensors:
        raise CheckpointError(f"checkpoint is missing tensor {key!r}")
    return np.asarray(tensors[key], dtype=np.float32)


def assign(variable: nnx.Variable, value: np.ndarray, name: str) -> None:
    """Sets ``variable`` to ``value``, refusing a shape mismatch (``name`` is the source key)."""
    value = np.asarray(value)
    current = variable.get_value()
    want = tuple(current.shape)
    if tuple(value.shape) != want:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(value.shape)}, the model expects {want}")
    # set_value replaces the array outright (indexed assignment would compile an update per shape).
    variable.set_value(jnp.asarray(value, dtype=current.dtype))


def linear_in_out(weight: np.ndarray, out_shape: Sequence[int]) -> np.ndarray:
    """torch ``[out, in]`` -> jaxmoe ``[in, *out_shape]``."""
    return weight.T.reshape((weight.shape[1], *out_shape))


def linear_heads_out(weight: np.ndarray, in_shape: Sequence[int]) -> np.ndarray:
    """torch ``[out, in]`` with ``in`` = heads x head_dim -> jaxmoe ``[*in_shape, out]``."""
    return weight.T.reshape((*in_shape, weight.shape[0]))
