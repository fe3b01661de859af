"""Shared by the whole-model tests: the tiny config, next-token loss and gradients, and their comparison."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TINY_CONFIG = pathlib.Path(__file__).parents[1] / "configs/tiny.py"


def loss_and_grads(model: nnx.Module, inputs, targets) -> tuple[jax.Array, nnx.State]:
    """Mean next-token cross-entropy of ``model`` on ``inputs`` ``[B, T]`` against ``targets`` ``[B, T]``,
    and its gradient with respect to every ``nnx.Param``, under ``jax.jit``.

    Returns:
      ``(loss [] float32, grads)``, ``grads`` an ``nnx.State`` shaped like the model's parameters.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def f(params, rest, inputs, targets):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(inputs)  # [B, T, V]
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

        return jax.value_and_grad(loss)(params)

    return f(params, rest, inputs, targets)


def assert_same_loss_and_grads(loss, grads: nnx.State, loss0, grads0: nnx.State, atol: float) -> None:
    """``loss`` and every gradient leaf equal the reference ``loss0``/``grads0`` within ``atol`` (rtol 0)."""
    np.testing.assert_allclose(float(loss), float(loss0), rtol=0, atol=atol)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol),
        nnx.to_pure_dict(grads),
        nnx.to_pure_dict(grads0),
    )
