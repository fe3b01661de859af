"""GRPO loss math in plain ``jnp``: group-relative advantages and the clipped, IS-corrected token loss.

Shape letters: N completions (``P`` prompts x ``G`` completions each), B batch (sequences), T tokens.

The conventions follow TRL's ``GRPOTrainer`` and DAPO (described in words; the code is our own):

- **Advantages** are relative to the prompt's group of ``G`` sampled completions:
  ``A_i = r_i - mean(r_group)``, divided by ``std(r_group) + eps`` when scaling (TRL's default:
  the unbiased, ``ddof=1`` standard deviation and ``eps = 1e-4``). A group whose rewards are all
  equal carries no signal and gets advantages of exactly 0.
- **Clipped objective** (PPO with DAPO's decoupled "clip-higher" range): per token
  ``ratio = exp(logp - old_logp)`` and ``objective = min(ratio * A, clip(ratio, 1 - eps_low,
  1 + eps_high) * A)``; the per-token loss is ``-objective``. ``old_logp`` is the trainer's own
  logprob before this batch's updates, so on the first update of a batch ``ratio == 1``.
- **KL to a reference** (optional, ``beta > 0``): the k3 estimator ``exp(ref - logp) - (ref - logp)
  - 1`` per token, non-negative and unbiased for ``KL(policy || ref)``, added as ``beta * k3``.
- **Engine / trainer mismatch**: the inference engine samples with its own numerics, so its
  logprobs ``engine_logp`` differ from the trainer's. Each sequence gets the importance weight
  ``w_b = exp(sum_t mask * (old_logp - engine_logp))`` (no gradient), and sequences with
  ``w_b > is_cap`` are masked out entirely ("masked importance sampling": truncating to the cap
  would keep a biased sample, dropping it keeps the estimate honest for the rest).
- **Token-level aggregation** (DAPO, TRL's ``"dapo"`` / ``"token"`` loss types): the loss is the sum
  over every completion token of the batch of ``w_b * mask * loss_token`` divided by the number of
  completion tokens, so long completions are not down-weighted as in per-sequence means.

Everything is computed in float32 (float64 inputs under ``jax.enable_x64`` stay float64). The
hyperparameters are static Python numbers: jit with ``functools.partial`` or ``static_argnames``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def _float(x) -> jax.Array:
    """``x`` as float32, or float64 if it already is (under ``jax.enable_x64``)."""
    x = jnp.asarray(x)
    return x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def group_advantages(rewards: jax.Array, group_size: int, *, scale: bool = True, eps: float = 1e-4) -> jax.Array:
    """Group-relative advantages: each reward minus its group's mean, optionally over its std.

    Args:
      rewards: ``[N]`` float rewards, ``N = P * group_size``, groups contiguous: rows
        ``g * G .. g * G + G - 1`` are the completions of prompt ``g``.
      group_size: ``G``, completions per prompt; at least 2 (the std of one sample is undefined).
      scale: divide by the group's unbiased (``ddof=1``) standard deviation plus ``eps``.
      eps: added to the standard deviation so a group with equal rewards divides by ``eps``, not 0.

    Returns:
      ``[N]`` float32 advantages; exactly 0 for every member of a group whose rewards are all equal.

    Raises:
      ValueError: ``rewards`` is not 1-D, ``group_size`` is below 2 or does not divide ``N``, or
        ``eps`` is negative.
    """
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (std of a group of 1 is undefined), got {group_size!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards = _float(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {rewards.shape}")
    (n,) = rewards.shape
    if n % group_size:
        raise ValueError(f"rewards length {n} is not a multiple of group_size={group_size}")
    r = rewards.reshape(n // group_size, group_size)  # [P, G]
    # Shifting by the group's first reward before averaging makes equal rewards give exactly 0
    # (a float sum of G equal values divided by G need not round back to the value itself).
    d = r - r[:, :1]
    centered = d - jnp.mean(d, axis=1, keepdims=True)
    if scale:
        std = jnp.sqrt(jnp.sum(centered * centered, axis=1, keepdims=True) / (group_size - 1))
        centered = centered / (std + eps)
    return centered.reshape(n)


class LossTerms(NamedTuple):
    """The GRPO loss and its diagnostics, every field a ``[]`` float32 scalar.

    Attributes:
      loss: the objective to minimise, ``policy_loss`` plus ``beta`` times the IS-weighted KL.
      policy_loss: the clipped-surrogate part alone (same IS weights and token normalisation).
      kl: masked token mean of the k3 KL estimate (unweighted); 0 without ``ref_logp``.
      clip_low_fraction: fraction of completion tokens clipped below (``ratio < 1 - eps_low``, ``A < 0``).
      clip_high_fraction: fraction of completion tokens clipped above (``ratio > 1 + eps_high``, ``A > 0``).
      is_ratio_mean: mean engine-to-trainer importance weight over sequences with at least one token.
      is_ratio_max: the largest such weight (0 when no sequence has a token).
      is_masked_fraction: fraction of those sequences whose weight exceeds ``is_cap`` (dropped).
      tokens: number of completion tokens, ``sum(mask)``.
    """

    loss: jax.Array
    policy_loss: jax.Array
    kl: jax.Array
    clip_low_fraction: jax.Array
    clip_high_fraction: jax.Array
    is_ratio_mean: jax.Array
    is_ratio_max: jax.Array
    is_masked_fraction: jax.Array
    tokens: jax.Array


def _validate(logp, old_logp, engine_logp, advantages, mask, ref_logp, epsilon_low, epsilon_high, beta, is_cap):
    """Raises ValueError naming the first argument whose shape or value is not allowed."""
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
    arrays = {"old_logp": old_logp, "engine_logp": engine_logp, "mask": mask}
    if ref_logp is not None:
        arrays["ref_logp"] = ref_logp
    for name, x in arrays.items():
        if x.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape [B, T] = {logp.shape}, got {x.shape}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = {logp.shape[:1]}, got {advantages.shape}")
    if not 0 <= epsilon_low < 1:
        raise ValueError(f"epsilon_low must be in [0, 1), got {epsilon_low}")
    if not epsilon_high >= 0:
        raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high}")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta > 0 (got beta={beta})")
    if not is_cap > 0:
        raise ValueError(f"is_cap must be > 0 (float('inf'): never mask), got {is_cap}")


def _sequence_weights(old_logp, engine_logp, valid, is_cap):
    """Engine-to-trainer IS weights ``[B]`` (0 where above ``is_cap``) and their metrics."""
    log_w = jnp.sum(jnp.where(valid, old_logp - engine_logp, 0.0), axis=1)  # [B]
    w = jax.lax.stop_gradient(jnp.exp(log_w))
    over = w > is_cap
    weight = jnp.where(over, 0.0, w)
    has_tokens = jnp.any(valid, axis=1)  # [B]
    n_seq = jnp.maximum(jnp.sum(has_tokens), 1).astype(w.dtype)
    ratio_mean = jnp.sum(jnp.where(has_tokens, w, 0.0)) / n_seq
    ratio_max = jnp.max(jnp.where(has_tokens, w, 0.0))  # w > 0, so 0 only when no sequence has a token
    masked_fraction = jnp.sum(has_tokens & over).astype(w.dtype) / n_seq
    return weight, ratio_mean, ratio_max, masked_fraction


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    engine_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    ref_logp: jax.Array | None = None,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    beta: float = 0.0,
    is_cap: float = 2.0,
) -> LossTerms:
    """The GRPO / DAPO token-level loss with masked sequence-level importance sampling.

    Args:
      logp: ``[B, T]`` the trainer's current logprobs of the completion tokens (differentiated).
      old_logp: ``[B, T]`` the trainer's logprobs before this batch's updates (no gradient).
      engine_logp: ``[B, T]`` the logprobs the inference engine reported when sampling (no gradient).
      advantages: ``[B]`` one advantage per sequence (e.g. from :func:`group_advantages`).
      mask: ``[B, T]`` bool or float, 1 on completion tokens and 0 on prompt and padding.
      ref_logp: ``[B, T]`` the reference policy's logprobs, required iff ``beta > 0`` (no gradient).
      epsilon_low: lower clip ``ratio >= 1 - epsilon_low``, in ``[0, 1)``.
      epsilon_high: upper clip ``ratio <= 1 + epsilon_high`` (DAPO's clip-higher), ``>= 0``.
      beta: weight of the k3 KL to ``ref_logp``, ``>= 0``.
      is_cap: sequences whose weight ``exp(sum mask * (old_logp - engine_logp))`` exceeds it are
        dropped; ``> 0``, ``float('inf')`` never drops.

    Returns:
      :class:`LossTerms` of ``[]`` float32 scalars; ``loss`` is the one to differentiate.

    Raises:
      ValueError: an array's shape differs from ``logp``'s ``[B, T]`` (``advantages``: ``[B]``), a
        hyperparameter is out of range, or ``ref_logp`` is missing with ``beta > 0``.
    """
    logp, old_logp, engine_logp, advantages, mask = map(_float, (logp, old_logp, engine_logp, advantages, mask))
    ref_logp = None if ref_logp is None else _float(ref_logp)
    _validate(logp, old_logp, engine_logp, advantages, mask, ref_logp, epsilon_low, epsilon_high, beta, is_cap)
    old_logp, engine_logp = jax.lax.stop_gradient(old_logp), jax.lax.stop_gradient(engine_logp)
    valid = mask > 0
    tokens = jnp.sum(mask)
    denom = jnp.maximum(tokens, 1.0)

    with jax.named_scope("is_weights"):
        weight, ratio_mean, ratio_max, masked_fraction = _sequence_weights(old_logp, engine_logp, valid, is_cap)
        token_weight = weight[:, None] * mask  # [B, T]

    with jax.named_scope("clipped_objective"):
        # Zeroed off the mask before exp so padding logprobs (possibly -inf) never reach the loss.
        ratio = jnp.exp(jnp.where(valid, logp - old_logp, 0.0))  # [B, T]
        a = advantages[:, None]
        clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        per_token = -jnp.minimum(ratio * a, clipped * a)
        policy_loss = jnp.sum(token_weight * per_token) / denom
        clip_low = jnp.sum(mask * ((ratio < 1.0 - epsilon_low) & (a < 0))) / denom
        clip_high = jnp.sum(mask * ((ratio > 1.0 + epsilon_high) & (a > 0))) / denom

    with jax.named_scope("kl"):
        if ref_logp is None:
            kl, loss = jnp.zeros((), logp.dtype), policy_loss
        else:
            delta = jnp.where(valid, jax.lax.stop_gradient(ref_logp) - logp, 0.0)
            k3 = jnp.exp(delta) - delta - 1.0  # [B, T]
            kl = jnp.sum(mask * k3) / denom
            loss = policy_loss + beta * jnp.sum(token_weight * k3) / denom if beta > 0 else policy_loss

    return LossTerms(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl,
        clip_low_fraction=clip_low,
        clip_high_fraction=clip_high,
        is_ratio_mean=ratio_mean,
        is_ratio_max=ratio_max,
        is_masked_fraction=masked_fraction,
        tokens=tokens,
    )
