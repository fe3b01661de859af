"""KDA over a sequence sharded along the ``context`` mesh axis: conv halo, composed delta-rule states.

- :func:`context_parallel_delta_rule`: the state after a shard is affine in the state before it,
  ``S_out = M S_in + S0``. One local chunked scan computes ``S0``, ``M`` and the per-token outputs'
  dependence on ``S_in`` (the state gets ``H`` extra value columns that start at the identity and
  are written with zeros); the small ``(M, S0)`` pairs are all-gathered, composed into each
  shard's incoming state, and the outputs corrected. The result is the unsharded scan.
- :func:`context_parallel_conv` runs the short causal conv with a halo of the previous shard's
  last ``K-1`` inputs.

Shape letters: B batch, T sequence length (global; ``_local`` values hold T/P), N heads, H key
head dim, V value head dim, K conv kernel, P shards on ``context``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.attention.context_parallel import CONTEXT, check_length, context_parallel_size, rule_axes, varying_like
from jaxmoe.attention.delta_rule import chunked_delta_rule


def context_parallel_conv(qkv: jax.Array, w: jax.Array, conv_state: jax.Array, conv_fn) -> tuple[jax.Array, jax.Array]:
    """A causal depthwise conv over a context-sharded sequence.

    Args:
        qkv: ``[B, T, ...]`` conv inputs, T sharded over ``context``.
        w: ``[K, ...]`` taps (replicated over ``context``).
        conv_state: ``[B, K-1, ...]`` the inputs before the first token (shard 0's halo).
        conv_fn: ``conv_fn(x_local, w, halo) -> (y_local, new_halo)``, the local conv.

    Returns:
        ``y [B, T, ...]`` sharded like ``qkv`` and the last K-1 inputs ``[B, K-1, ...]`` (the new
        conv state).
    """
    p, kw = context_parallel_size(), w.shape[0]
    B, T = qkv.shape[:2]
    check_length("qkv", T, p, "one slice per shard")
    if T // p < kw - 1:
        raise ValueError(
            f"qkv has {T // p} tokens per 'context' shard; the short conv needs at least "
            f"conv_kernel - 1 = {kw - 1} (the halo comes from one neighbour)"
        )
    heads = qkv.shape[3] if qkv.ndim >= 4 else None
    x_spec = PartitionSpec(rule_axes("batch", B), CONTEXT, *[None] * (qkv.ndim - 2))
    if heads is not None:  # [B, T, 3, N, H]: heads are dimension 3
        x_spec = PartitionSpec(*x_spec[:3], rule_axes("act_heads", heads), *x_spec[4:])
    state_spec = PartitionSpec(x_spec[0], None, *x_spec[2:])
    w_spec = PartitionSpec(None, *x_spec[2:])

    def body(x_local, w, state):
        idx = jax.lax.axis_index(CONTEXT)
        if kw > 1:
            halo = jax.lax.ppermute(x_local[:, T // p - (kw - 1) :], CONTEXT, [(d, d + 1) for d in range(p - 1)])
            halo = jnp.where(idx == 0, varying_like(state, halo), halo)
        else:
            halo = varying_like(state, x_local)
        y, tail = conv_fn(x_local, w, halo)
        # The new state is the last shard's tail; a masked psum makes it the same on every shard.
        tail = jax.lax.psum(jnp.where(idx == p - 1, tail, jnp.zeros_like(tail)), CONTEXT)
        return y, tail

    return jax.shard_map(body, in_specs=(x_spec, w_spec, state_spec), out_specs=(x_spec, state_spec))(
        qkv, w, conv_state
    )


def context_parallel_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size=64) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a context-sharded sequence; equals ``chunked_delta_rule``.

    Args and returns as :func:`jaxmoe.attention.delta_rule.chunked_delta_rule` (``q, k, g [B, T, N, H]``,
    ``v [B, T, N, V]``, ``beta [B, T, N]``, state ``[B, N, H, V]`` float32), T sharded over
    ``context``. Each shard scans only its own T/P tokens (in chunks of ``chunk_size``); the
    one sequential step left is a P-term fold of ``[H, H]`` matrices, done redundantly on every
    shard after one all-gather. The local scan carries ``V + H`` value columns instead of V.
    """
    p = context_parallel_size()
    B, T, N, H = k.shape
    V = v.shape[-1]
    check_length("q", T, p, "one slice per shard")
    dtype = q.dtype
    state0 = jnp.zeros((B, N, H, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    b_axes, h_axes = rule_axes("batch", B), rule_axes("act_heads", N)
    x_spec = PartitionSpec(b_axes, CONTEXT, h_axes, None)
    state_spec = PartitionSpec(b_axes, h_axes, None, None)

    def body(q, k, v, g, beta, state0):
        q = q.astype(jnp.float32)
        b, t = q.shape[:2]
        n = q.shape[2]
        with jax.named_scope("kda_local_scan"):
            # Extra columns start at the identity and receive no writes: they track M, the
            # state map, and the outputs' dependence on the incoming state (M_t^T q_t).
            v_aug = jnp.concatenate([v.astype(jnp.float32), jnp.zeros((b, t, n, H), jnp.float32)], axis=-1)
            s_aug = jnp.concatenate(
                [jnp.zeros((b, n, H, V), jnp.float32), jnp.broadcast_to(jnp.eye(H, dtype=jnp.float32), (b, n, H, H))],
                axis=-1,
            )
            o_aug, s_aug = chunked_delta_rule(q, k, v_aug, g, beta, varying_like(s_aug, q), chunk_size)
            o0, o_m = o_aug[..., :V], o_aug[..., V:]  # [B, T, N, V], [B, T, N, H]
            s0, m = s_aug[..., :V], s_aug[..., V:]  # [B, N, H, V], [B, N, H, H]: S_out = M S_in + S0
        with jax.named_scope("kda_boundary_states"):
            all_m = jax.lax.all_gather(m, CONTEXT, to="invarying")  # [P, B, N, H, H]
            all_s0 = jax.lax.all_gather(s0, CONTEXT, to="invarying")  # [P, B, N, H, V]

            def fold(s, xs):
                m_i, s0_i = xs
                return jnp.einsum("BNHG,BNGV->BNHV", m_i, s, precision="highest") + s0_i, s

            final, incoming = jax.lax.scan(fold, state0, (all_m, all_s0))  # incoming: [P, B, N, H, V]
            s_in = incoming[jax.lax.axis_index(CONTEXT)]
            o = o0 + jnp.einsum("BTNG,BNGV->BTNV", o_m, s_in, precision="highest")
        return o.astype(dtype), final

    fn = jax.shard_map(
        body,
        in_specs=(x_spec, x_spec, x_spec, x_spec, PartitionSpec(b_axes, CONTEXT, h_axes), state_spec),
        out_specs=(x_spec, state_spec),
    )
    return fn(q, k, v, g, beta, state0)
