"""The trainer side of GRPO: log-probabilities of the sampled tokens and the jitted update.

The update is a module-level function of ``(graphdef, RLConfig)`` (static) and the state and the
batch, on the training mesh with the training rules' shardings: the same parameters the rollout
engine reads (:meth:`jaxmoe.inference.engine.Engine` keeps them as they are), so weights never
travel through the host between rollouts and updates.

Shape letters: B rollouts, T positions, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.rl.config import RLConfig
from jaxmoe.rl.grpo import grpo_loss
from jaxmoe.sharding import logical_to_spec
from jaxmoe.train.optim import learning_rate, model_optimizer
from jaxmoe.train.step import Trainer, set_dense_dsa


class RLState(NamedTuple):
    params: dict
    router_bias: dict  # fixed during RL (the balance update is a pre-training device)
    opt_state: object


class Batch(NamedTuple):
    inputs: jax.Array  # [B, T] int32
    targets: jax.Array  # [B, T] int32
    allowed: jax.Array  # [B, T, V] bool
    mask: jax.Array  # [B, T] float32
    engine_logp: jax.Array  # [B, T] float32
    advantages: jax.Array  # [B] float32
    old_logp: jax.Array  # [B, T] float32: the trainer's before the batch's updates (unused when on-policy)
    ref_logp: jax.Array  # [B, T] float32: the reference policy's (unused when beta = 0)


def token_logprobs(logits: jax.Array, targets: jax.Array, allowed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``log p(targets)`` and the entropy at every position, under the distribution restricted to ``allowed``.

    Args:
      logits: ``[B, T, V]``; targets: ``[B, T]``; allowed: ``[B, T, V]`` bool (the constraint's set).

    Returns:
      ``logp [B, T]`` and ``entropy [B, T]``, float32.
    """
    z = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
    logz = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logz, targets[..., None], axis=-1)[..., 0]
    p = jnp.exp(logz)
    entropy = -jnp.sum(jnp.where(allowed, p * logz, 0.0), axis=-1)
    return logp, entropy


def policy_logprobs(graphdef, params: dict, router_bias: dict, inputs, targets, allowed):
    model = nnx.merge(graphdef, params, router_bias)
    set_dense_dsa(model, False)
    return token_logprobs(model(inputs), targets, allowed)


def rl_step(graphdef, rl: RLConfig, state: RLState, batch: Batch) -> tuple[RLState, dict]:
    """One GRPO update: ``(new state, metrics)`` (metrics replicated scalars)."""
    tx = model_optimizer(rl.optim, rl.steps * rl.updates_per_batch)

    def loss(params):
        logp, entropy = policy_logprobs(graphdef, params, state.router_bias, batch.inputs, batch.targets, batch.allowed)
        old = jax.lax.stop_gradient(logp) if rl.updates_per_batch == 1 else batch.old_logp
        terms = grpo_loss(
            logp,
            old,
            batch.engine_logp,
            batch.advantages,
            batch.mask,
            batch.ref_logp if rl.beta > 0 else None,
            epsilon_low=rl.epsilon_low,
            epsilon_high=rl.epsilon_high,
            beta=rl.beta,
            is_cap=rl.is_cap,
        )
        return terms.loss, (terms, logp, entropy)

    (_, (terms, logp, entropy)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    updates, opt = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.maximum(batch.mask.sum(), 1.0)
    diff = jnp.abs(jax.lax.stop_gradient(logp) - batch.engine_logp) * batch.mask
    metrics = {
        **terms._asdict(),
        "entropy": (entropy * batch.mask).sum() / n,
        "grad_norm": optax.global_norm(grads),
        "logprob_diff_mean": diff.sum() / n,
        "logprob_diff_max": diff.max(),
    }
    return RLState(params, state.router_bias, opt), metrics


class RLTrainer:
    """The RL state's shardings and the jitted update and log-probabilities on ``mesh``.

    Args:
      trainer: the training :class:`Trainer` of the model's config (graph, parameter shardings).
      rl: the RL config.
    """

    def __init__(self, trainer: Trainer, rl: RLConfig):
        self.trainer, self.rl = trainer, rl
        self.mesh = trainer.mesh
        self.tx = model_optimizer(rl.optim, rl.steps * rl.updates_per_batch)
        schedule = learning_rate(rl.optim, rl.steps * rl.updates_per_batch)
        self.learning_rate = lambda step: schedule(step * rl.updates_per_batch)
        abstract = trainer.abstract_state()
        opt = trainer._opt_shardings(self.tx, abstract.params, trainer.state_shardings.params)
        self.state_shardings = RLState(trainer.state_shardings.params, trainer.state_shardings.router_bias, opt)
        rows = NamedSharding(self.mesh, logical_to_spec(("batch", "seq")))
        self.batch_shardings = Batch(
            rows,
            rows,
            NamedSharding(self.mesh, logical_to_spec(("batch", "seq", None))),
            rows,
            rows,
            NamedSharding(self.mesh, logical_to_spec(("batch",))),
            rows,
            rows,
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        masks = self.batch_shardings.allowed
        self._step = jax.jit(
            rl_step,
            static_argnums=(0, 1),
            in_shardings=(self.state_shardings, self.batch_shardings),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=2,
        )
        self._logprobs = jax.jit(
            policy_logprobs,
            static_argnums=0,
            in_shardings=(self.state_shardings.params, self.state_shardings.router_bias, rows, rows, masks),
            out_shardings=(rows, rows),
        )

    def init_opt(self, params: dict):
        return jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)

    def abstract_opt(self):
        shapes = jax.eval_shape(self.tx.init, self.trainer.abstract_state().params)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.state_shardings.opt_state
        )

    def step(self, state: RLState, batch: Batch) -> tuple[RLState, dict]:
        return self._step(self.trainer.graphdef, self.rl, state, batch)

    def logprobs(self, params: dict, router_bias: dict, inputs, targets, allowed) -> tuple[jax.Array, jax.Array]:
        """The trainer's ``(logp, entropy) [B, T]`` of ``targets`` under ``allowed`` (global arrays)."""
        return self._logprobs(self.trainer.graphdef, params, router_bias, inputs, targets, allowed)

    def put(self, array, sharding: NamedSharding) -> jax.Array:
        """A host array (the same on every process) as a global array of ``sharding``."""
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
