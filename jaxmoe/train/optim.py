"""The optimizers: AdamW with warm-up then cosine decay for the model, a constant-rate one for the
DSA indexer's dense warm-up.

Both clip the global gradient norm first. Weight decay is decoupled (AdamW) and applies to
matrices only: norm scales and the router bias are not decayed (the bias is no parameter of the
optimizer at all; :mod:`jaxmoe.train.step` updates it from the expert load).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxmoe.config import OptimConfig
from jaxmoe.layer_plan import STACK_KEY


def learning_rate(o: OptimConfig, steps: int):
    """The schedule ``count -> rate`` over ``steps`` updates (``count`` = updates already made).

    Linear warm-up to ``o.learning_rate`` over ``o.warmup_steps`` updates (the first update uses
    ``lr / warmup_steps``, not 0), then a cosine to ``lr * o.min_lr_ratio`` reached at the last
    update (``count = steps - 1``). Works on Python ints and traced arrays alike.
    """
    peak, floor = o.learning_rate, o.learning_rate * o.min_lr_ratio
    warmup = min(o.warmup_steps, steps)
    decay = max(steps - warmup - 1, 1)

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = peak * (s + 1.0) / max(warmup, 1)
        progress = jnp.clip((s - warmup) / decay, 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(s < warmup, warm, cosine)

    return schedule


def _decay_mask(params):
    """Matrices decay, vectors (norm weights, biases) do not; a stacked layer's leading axes
    (one per ``STACK_KEY`` on its path, :mod:`jaxmoe.layer_plan`) do not count."""

    def decays(path, p):
        stacked = sum(1 for k in path if getattr(k, "key", None) == STACK_KEY)
        return p.ndim - stacked >= 2

    return jax.tree_util.tree_map_with_path(decays, params)


def _clip(max_norm: float) -> optax.GradientTransformation:
    return optax.clip_by_global_norm(max_norm) if max_norm > 0 else optax.identity()


def model_optimizer(o: OptimConfig, steps: int) -> optax.GradientTransformation:
    """Clip, then AdamW with :func:`learning_rate` over ``steps`` updates."""
    return optax.chain(
        _clip(o.grad_clip),
        optax.adamw(
            learning_rate(o, steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=_decay_mask
        ),
    )


def indexer_warmup_optimizer(o: OptimConfig, rate: float) -> optax.GradientTransformation:
    """The dense warm-up's optimizer of the indexer parameters: clip, then Adam at a constant ``rate``."""
    return optax.chain(_clip(o.grad_clip), optax.adam(rate, b1=o.b1, b2=o.b2, eps=o.eps))
