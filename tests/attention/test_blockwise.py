"""Blockwise online-softmax attention equals the dense reference, forward and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.attention.blockwise import attention_reference, blockwise_attention, blockwise_partials, merge_partials

TOL = dict(rtol=0, atol=1e-5)


def _inputs(seed, B=2, T=37, S=37, N=3, H=11, V=7):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k = jax.random.normal(ks[1], (B, S, N, H))
    v = jax.random.normal(ks[2], (B, S, N, V))
    r = jax.random.normal(ks[3], (B, T, N, V))
    return q, k, v, r


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("blocks", [(8, 8), (16, 5), (64, 64)])
def test_causal_self_attention(seed, blocks):
    q, k, v, r = _inputs(seed)
    pos = jnp.broadcast_to(jnp.arange(37, dtype=jnp.int32), (2, 37))
    bq, bk = blocks

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * r)

    fast = lambda q, k, v: blockwise_attention(q, k, v, pos, pos, 0.3, block_q=bq, block_k=bk)  # noqa: E731
    slow = lambda q, k, v: attention_reference(q, k, v, pos, pos, 0.3)  # noqa: E731
    np.testing.assert_allclose(jax.jit(fast)(q, k, v), jax.jit(slow)(q, k, v), **TOL)
    g_fast = jax.jit(jax.grad(lambda *a: loss(fast, *a), argnums=(0, 1, 2)))(q, k, v)
    g_slow = jax.jit(jax.grad(lambda *a: loss(slow, *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_fast, g_slow):
        np.testing.assert_allclose(a, b, **TOL)


def test_chunk_against_longer_cache_and_unseen_queries():
    """Queries at positions 20..32 against 41 cached keys, some in their future; a query placed
    before every key sees nothing and returns zeros."""
    q, k, v, _ = _inputs(3, T=13, S=41)
    q_pos = jnp.broadcast_to(jnp.arange(20, 33, dtype=jnp.int32), (2, 13)).at[1, 0].set(-5)
    kv_pos = jnp.broadcast_to(jnp.arange(41, dtype=jnp.int32), (2, 41))
    got = blockwise_attention(q, k, v, q_pos, kv_pos, 0.5, block_q=4, block_k=6)
    want = attention_reference(q, k, v, q_pos, kv_pos, 0.5)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_array_equal(np.asarray(got[1, 0]), 0.0)


def test_merge_partials_over_key_shards():
    """Attention over keys split in two shards, merged by log-sum-exp, equals attention over all."""
    q, k, v, _ = _inputs(4, T=19, S=30)
    q_pos = jnp.broadcast_to(jnp.arange(11, 30, dtype=jnp.int32), (2, 19))
    kv_pos = jnp.broadcast_to(jnp.arange(30, dtype=jnp.int32), (2, 30))
    a = blockwise_partials(q, k[:, :13], v[:, :13], q_pos, kv_pos[:, :13], 0.4, block_q=8, block_k=8)
    b = blockwise_partials(q, k[:, 13:], v[:, 13:], q_pos, kv_pos[:, 13:], 0.4, block_q=8, block_k=8)
    out, _ = merge_partials(*a, *b)
    np.testing.assert_allclose(out, attention_reference(q, k, v, q_pos, kv_pos, 0.4), **TOL)
