"""Context parallelism: attention over a sequence sharded along the ``context`` mesh axis.

Everything here runs inside ``jax.shard_map`` over the whole mesh: the sequence dimension is split
over ``context``, batch dimensions stay split over the axes the ``batch`` rule names, heads over
the axes of ``act_heads``, and the collectives are the ones written here, not ones the compiler
picks. Callers see global arrays ``x[B_data, T_context, ...]``.

- MLA, :func:`ring_mla_attention`: ring attention. Each shard keeps its queries; the KV *latent*
  (``c_kv``, ``k_rope`` and their positions, ``C + R`` numbers a token instead of ``N (Hn + Hv)``)
  travels round the ring with ``ppermute``; each step expands the visiting block through
  ``kv_b`` and merges its :func:`blockwise_partials` into the running result by log-sum-exp.
  Visibility is by position, so any token layout is correct. The backward pass is written out
  (``custom_vjp``): it sends the latent round the ring again with its gradient travelling beside
  it, so a shard holds O(T/P) activations, not the whole sequence's.
- Zig-zag layout, :func:`to_zigzag` / :func:`from_zigzag`: with 2P chunks of the sequence, shard
  ``p`` holds chunks ``p`` and ``2P-1-p``, so under a causal mask every shard has the same
  amount of visible work (a contiguous split leaves shard 0 idle while shard P-1 sees
  everything). MLA permutes its input to this layout and its output back, so callers keep the
  contiguous layout.
- KDA, :func:`context_parallel_delta_rule`: the state after a shard is affine in the state before
  it, ``S_out = M S_in + S0``. One local chunked scan computes ``S0``, ``M`` and the per-token
  outputs' dependence on ``S_in`` (the state gets ``H`` extra value columns that start at the
  identity and are written with zeros); the small ``(M, S0)`` pairs are all-gathered, composed
  into each shard's incoming state, and the outputs corrected. The result is the unsharded scan.
  :func:`context_parallel_conv` runs the short causal conv with a halo of the previous shard's
  last ``K-1`` inputs.

A layer chooses these paths itself when a mesh is set whose ``context`` axis has size > 1
(:func:`context_parallel_size`). Hook for other attention kinds (DSA): test
``context_parallel_size() > 1``, use :func:`token_spec` for the ``shard_map`` specs and
:func:`to_zigzag` / :func:`from_zigzag` for the balanced layout.

Shape letters: B batch, T query length (global; ``_local`` values hold T/P), S key length, N
heads, H key head dim, V value head dim, C kv latent dim, R rope dim, K conv kernel, P shards
on ``context``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.attention.blockwise import blockwise_partials, merge_partials
from jaxmoe.nn import dense
from jaxmoe.sharding import RULES

CONTEXT = "context"


# --------------------------------------------------------------------------------------------
# Mesh queries and specs


def context_parallel_size() -> int:
    """Size of the ``context`` axis of the mesh set with ``jax.set_mesh``; 1 without one.

    Inside a ``shard_map`` that is already manual over ``context`` the sequence is already
    local, so this returns 1 there too.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT not in mesh.axis_names:
        return 1
    if dict(zip(mesh.axis_names, mesh.axis_types))[CONTEXT] == jax.sharding.AxisType.Manual:
        return 1
    return mesh.shape[CONTEXT]


def _rule_axes(logical: str, size: int) -> str | tuple[str, ...] | None:
    """Mesh axes of ``RULES[logical]`` that evenly split a dimension of ``size`` (a prefix).

    A dimension the rule's axes do not divide (batch 1 on a data-2 mesh) stays replicated over
    the rest rather than failing inside ``shard_map``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = dict(RULES)[logical]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    kept, prod = [], 1
    for a in axes:
        if a not in mesh.axis_names or size % (prod * mesh.shape[a]):
            break
        kept.append(a)
        prod *= mesh.shape[a]
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def token_spec(batch: int, rank: int, heads: int | None = None) -> PartitionSpec:
    """``shard_map`` spec of a ``[B, T, ...]`` array with T on ``context``.

    Args:
        batch: the array's batch size B (its axes follow the ``batch`` rule where they divide it).
        rank: the array's rank (>= 2).
        heads: size of dimension 2 if it is a heads dimension (split like ``act_heads``).
    """
    rest = [None] * (rank - 2)
    if heads is not None:
        rest[0] = _rule_axes("act_heads", heads)
    return PartitionSpec(_rule_axes("batch", batch), CONTEXT, *rest)


def _check_length(name: str, length: int, multiple: int, why: str) -> None:
    if length % multiple:
        raise ValueError(
            f"{name} has sequence length {length}, which context parallelism over mesh axis "
            f"'context' (size {context_parallel_size()}) needs to be a multiple of {multiple} ({why})"
        )


def _vma(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (JAX 0.10 names it ``manual_axis_type``)."""
    return jax.typeof(x).manual_axis_type.varying


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` cast to vary over every mesh axis ``like`` varies over (scan carries must agree)."""
    missing = tuple(sorted(_vma(like) - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# --------------------------------------------------------------------------------------------
# Zig-zag layout


def _zigzag_shard(chunk: int, p: int) -> int:
    """Shard holding ``chunk`` (of 2P) in the zig-zag layout: p holds chunks p and 2P-1-p."""
    return chunk if chunk < p else 2 * p - 1 - chunk


def _zigzag_local(x_local: jax.Array, p: int, inverse: bool) -> jax.Array:
    """Contiguous <-> zig-zag on one shard's ``[B, T/P, ...]``; two ppermutes of half a shard.

    Contiguous: shard d holds chunks 2d, 2d+1. Zig-zag: slot 0 holds chunk d, slot 1 chunk
    2P-1-d; of those two, the even chunk is in slot 0 exactly when d is even.
    """
    even_perm = [(d, _zigzag_shard(2 * d, p)) for d in range(p)]
    odd_perm = [(d, _zigzag_shard(2 * d + 1, p)) for d in range(p)]
    first, second = jnp.split(x_local, 2, axis=1)
    d_even = jax.lax.axis_index(CONTEXT) % 2 == 0
    if inverse:
        even = jnp.where(d_even, first, second)
        odd = jnp.where(d_even, second, first)
        even = jax.lax.ppermute(even, CONTEXT, [(b, a) for a, b in even_perm])
        odd = jax.lax.ppermute(odd, CONTEXT, [(b, a) for a, b in odd_perm])
        return jnp.concatenate([even, odd], axis=1)
    even = jax.lax.ppermute(first, CONTEXT, even_perm)
    odd = jax.lax.ppermute(second, CONTEXT, odd_perm)
    return jnp.concatenate([jnp.where(d_even, even, odd), jnp.where(d_even, odd, even)], axis=1)


def _zigzag(x: jax.Array, inverse: bool) -> jax.Array:
    p = context_parallel_size()
    if p == 1:
        return x
    _check_length("zig-zag input", x.shape[1], 2 * p, "2P chunks, two per shard")
    spec = token_spec(x.shape[0], x.ndim)
    fn = functools.partial(_zigzag_local, p=p, inverse=inverse)
    return jax.shard_map(fn, in_specs=spec, out_specs=spec)(x)


def to_zigzag(x: jax.Array) -> jax.Array:
    """``[B, T, ...]`` in sequence order -> the zig-zag order of :func:`zigzag_order`.

    Identity without a context-parallel mesh. T must be a multiple of 2P.
    """
    return _zigzag(x, inverse=False)


def from_zigzag(x: jax.Array) -> jax.Array:
    """Inverse of :func:`to_zigzag`."""
    return _zigzag(x, inverse=True)


def zigzag_order(length: int, p: int) -> list[int]:
    """The token order of the zig-zag layout: ``to_zigzag(x) == x[:, zigzag_order(T, P)]``."""
    chunk = length // (2 * p)
    chunks = [c for d in range(p) for c in (d, 2 * p - 1 - d)]
    return [c * chunk + i for c in chunks for i in range(chunk)]


# --------------------------------------------------------------------------------------------
# Ring MLA


def _expand_kv(c_kv, k_rope, kv_b, nope_dim: int):
    """Latent ``c_kv[B, S, C]``, ``k_rope[B, S, R]`` -> keys ``[B, S, N, Hn+R]``, values ``[B, S, N, V]``."""
    kv = dense("BSC,CNH->BSNH", c_kv, kv_b)  # [B, S, N, Hn + V]
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    B, S, N, _ = k_nope.shape
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (B, S, N, k_rope.shape[-1]))  # shared by heads
    return jnp.concatenate([k_nope, k_rope], axis=-1), v


def _block_partials(q, c_kv, k_rope, kv_b, q_pos, kv_pos, *, scale, nope_dim, block_q, block_k):
    k, v = _expand_kv(c_kv, k_rope, kv_b, nope_dim)
    return blockwise_partials(q, k, v, q_pos, kv_pos, scale, block_q=block_q, block_k=block_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q, c_kv, k_rope, kv_b, q_pos, kv_pos, static):
    return _ring_fwd(q, c_kv, k_rope, kv_b, q_pos, kv_pos, static)[0]


def _ring_fwd(q, c_kv, k_rope, kv_b, q_pos, kv_pos, static):
    p, kw = static[0], dict(static[1:])
    shift = [(d, (d + 1) % p) for d in range(p)]

    def step(carry, _):
        out, lse, kv = carry
        # Send the block on while this shard works on it; the last step's send is unused.
        nxt = jax.lax.ppermute(kv, CONTEXT, shift)
        out_j, lse_j = _block_partials(q, kv[0], kv[1], kv_b, q_pos, kv[2], **kw)
        out, lse = merge_partials(out, lse, out_j, lse_j)
        return (out, lse, nxt), None

    B, T, N, _ = q.shape
    out0 = _varying_like(jnp.zeros((B, T, N, kv_b.shape[-1] - kw["nope_dim"]), q.dtype), q)
    lse0 = _varying_like(jnp.full((B, T, N), -jnp.inf, jnp.float32), q)
    (out, lse, _), _ = jax.lax.scan(step, (out0, lse0, (c_kv, k_rope, kv_pos)), length=p)
    return out, (q, c_kv, k_rope, kv_b, q_pos, kv_pos, out, lse)


def _ring_bwd(static, res, g):
    """Blocks visit in the forward order; each block's latent gradient travels with it.

    With ``out = sum_j w_j out_j``, ``w_j = exp(lse_j - lse)``, block j's partials receive
    cotangents ``w_j g`` (output) and ``w_j (<g, out_j> - <g, out>)`` (log-sum-exp).
    """
    p, kw = static[0], dict(static[1:])
    q, c_kv, k_rope, kv_b, q_pos, kv_pos, out, lse = res
    shift = [(d, (d + 1) % p) for d in range(p)]
    g32 = g.astype(jnp.float32)
    g_dot_out = jnp.sum(g32 * out.astype(jnp.float32), axis=-1)  # [B, T, N]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def step(carry, _):
        dq, dkv_b, kv, dkv = carry
        nxt = jax.lax.ppermute(kv, CONTEXT, shift)
        c, r, kp = kv
        fn = functools.partial(_block_partials, q_pos=q_pos, kv_pos=kp, **kw)
        (out_j, lse_j), vjp = jax.vjp(lambda q, c, r, w: fn(q, c, r, w), q, c, r, kv_b)
        w_j = jnp.where(jnp.isfinite(lse_j), jnp.exp(lse_j - lse_safe), 0.0)  # [B, T, N]
        ct_out = (w_j[..., None] * g32).astype(out_j.dtype)
        ct_lse = w_j * (jnp.sum(g32 * out_j.astype(jnp.float32), axis=-1) - g_dot_out)
        dq_j, dc_j, dr_j, dw_j = vjp((ct_out, ct_lse))
        dkv = jax.lax.ppermute((dkv[0] + dc_j, dkv[1] + dr_j), CONTEXT, shift)
        return (dq + dq_j, dkv_b + dw_j, nxt, dkv), None

    zeros = lambda x: _varying_like(jnp.zeros(x.shape, x.dtype), x)  # noqa: E731
    init = (zeros(q), zeros(kv_b), (c_kv, k_rope, kv_pos), (zeros(c_kv), zeros(k_rope)))
    # After p steps and p sends, each latent gradient is back on the shard that owns the block.
    (dq, dkv_b, _, (dc, dr)), _ = jax.lax.scan(step, init, length=p)
    return dq, dc, dr, dkv_b, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_mla_attention(
    q: jax.Array,
    c_kv: jax.Array,
    k_rope: jax.Array,
    kv_b: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
    *,
    nope_dim: int,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """MLA (expanded form) over a context-sharded sequence; the ring form of ``blockwise_attention``.

    Args:
        q: ``[B, T, N, Hn+R]`` queries, each head laid out ``[nope, rope]`` (rope already applied).
        c_kv: ``[B, S, C]`` normalised kv latents. k_rope: ``[B, S, R]`` rotated rope keys.
        kv_b: ``[C, N, Hn+V]`` the latent up-projection, ``[k_nope, v]`` per head.
        q_pos: ``[B, T]`` int32, kv_pos: ``[B, S]`` int32 positions; key s is visible to query t
            when ``kv_pos[s] <= q_pos[t]`` (any token order works).
        scale: softmax scale.
        nope_dim: Hn, the nope part of the per-head key.
        block_q, block_k: block sizes of the per-step blockwise attention.

    Returns:
        ``[B, T, N, V]`` in q's dtype; T sharded over ``context`` like ``q``.
    """
    p = context_parallel_size()
    if p == 1:
        raise ValueError("ring_mla_attention needs a mesh (jax.set_mesh) with a 'context' axis of size > 1")
    B, T, N, _ = q.shape
    _check_length("q", T, p, "one slice per shard")
    _check_length("c_kv", c_kv.shape[1], p, "one slice per shard")
    static = (p, ("scale", scale), ("nope_dim", nope_dim), ("block_q", block_q), ("block_k", block_k))
    kv_b_spec = PartitionSpec(None, _rule_axes("act_heads", N), None)

    def body(q, c_kv, k_rope, kv_b, q_pos, kv_pos):
        # kv_b's gradient is a sum over every shard's queries: make it vary like q inside so the
        # shard_map transpose does the sum (psum) over batch and context.
        return _ring(q, c_kv, k_rope, _varying_like(kv_b, q), q_pos, kv_pos, static)

    in_specs = (
        token_spec(B, 4, N),
        token_spec(B, 3),
        token_spec(B, 3),
        kv_b_spec,
        token_spec(B, 2),
        token_spec(B, 2),
    )
    fn = jax.shard_map(body, in_specs=in_specs, out_specs=token_spec(B, 4, N))
    return fn(q, c_kv, k_rope, kv_b, q_pos, kv_pos)


# --------------------------------------------------------------------------------------------
# KDA: short conv with a halo, delta rule with composed boundary states


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
    _check_length("qkv", T, p, "one slice per shard")
    if T // p < kw - 1:
        raise ValueError(
            f"qkv has {T // p} tokens per 'context' shard; the short conv needs at least "
            f"conv_kernel - 1 = {kw - 1} (the halo comes from one neighbour)"
        )
    heads = qkv.shape[3] if qkv.ndim >= 4 else None
    x_spec = PartitionSpec(_rule_axes("batch", B), CONTEXT, *[None] * (qkv.ndim - 2))
    if heads is not None:  # [B, T, 3, N, H]: heads are dimension 3
        x_spec = PartitionSpec(*x_spec[:3], _rule_axes("act_heads", heads), *x_spec[4:])
    state_spec = PartitionSpec(x_spec[0], None, *x_spec[2:])
    w_spec = PartitionSpec(None, *x_spec[2:])

    def body(x_local, w, state):
        idx = jax.lax.axis_index(CONTEXT)
        if kw > 1:
            halo = jax.lax.ppermute(x_local[:, T // p - (kw - 1) :], CONTEXT, [(d, d + 1) for d in range(p - 1)])
            halo = jnp.where(idx == 0, _varying_like(state, halo), halo)
        else:
            halo = _varying_like(state, x_local)
        y, tail = conv_fn(x_local, w, halo)
        # The new state is the last shard's tail; a masked psum makes it the same on every shard.
        tail = jax.lax.psum(jnp.where(idx == p - 1, tail, jnp.zeros_like(tail)), CONTEXT)
        return y, tail

    return jax.shard_map(body, in_specs=(x_spec, w_spec, state_spec), out_specs=(x_spec, state_spec))(
        qkv, w, conv_state
    )


def context_parallel_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a context-sharded sequence; equals ``chunked_delta_rule``.

    Args and returns as :func:`jaxmoe.attention.kda.chunked_delta_rule` (``q, k, g [B, T, N, H]``,
    ``v [B, T, N, V]``, ``beta [B, T, N]``, state ``[B, N, H, V]`` float32), T sharded over
    ``context``. Each shard scans only its own T/P tokens (in chunks of ``chunk_size``); the
    one sequential step left is a P-term fold of ``[H, H]`` matrices, done redundantly on every
    shard after one all-gather. The local scan carries ``V + H`` value columns instead of V.
    """
    from jaxmoe.attention.kda import chunked_delta_rule  # noqa: PLC0415 (kda imports this module at load)

    p = context_parallel_size()
    B, T, N, H = k.shape
    V = v.shape[-1]
    _check_length("q", T, p, "one slice per shard")
    dtype = q.dtype
    state0 = jnp.zeros((B, N, H, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    b_axes, h_axes = _rule_axes("batch", B), _rule_axes("act_heads", N)
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
            o_aug, s_aug = chunked_delta_rule(q, k, v_aug, g, beta, _varying_like(s_aug, q), chunk_size)
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
