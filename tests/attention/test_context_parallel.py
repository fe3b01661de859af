"""Context parallelism equals the unsharded layers: ring MLA, KDA with boundary states, zig-zag.

Every comparison is the same module (same parameters) run twice: without a mesh (the local
path) and under a mesh whose ``context`` axis has size 2, 4 or 8 (the context-parallel path),
forward and gradient with respect to the input and every parameter, fp32, 1e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.attention import context_parallel as cp
from jaxmoe.attention.blockwise import attention_reference
from jaxmoe.attention.kda import KDA, KDAState
from jaxmoe.attention.mla import MLA
from jaxmoe.attention.mla_context import ring_mla_attention
from jaxmoe.config import KDAConfig, MeshConfig, MLAConfig, ModelConfig, RopeConfig
from jaxmoe.sharding import make_mesh

TOL = dict(rtol=0, atol=1e-5)
B, T, D = 2, 48, 19  # T: a multiple of 2P for P = 2, 4, 8

# context size -> the other axes: batch split over data and heads over tensor where they fit.
MESHES = {
    2: MeshConfig(data=2, context=2, tensor=2),
    4: MeshConfig(data=2, context=4),
    8: MeshConfig(context=8),
}


def _jit(fn):
    """One jax.jit of ``fn(module, *args)``, split into (static graphdef, state) at the boundary."""
    run = jax.jit(lambda graphdef, state, *args: fn(nnx.merge(graphdef, state), *args), static_argnums=0)
    return lambda module, *args: run(*nnx.split(module), *args)


def _loss_grads(module, x, positions, r):
    """Output, and gradients of ``sum(y * r)`` wrt ``x`` and every parameter."""
    graphdef, params = nnx.split(module)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x, positions)
        return jnp.sum(y * r), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


_run = _jit(lambda m, x, positions, r: _loss_grads(m, x, positions, r))


def _assert_close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), **TOL), a, b)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    r = (rng.standard_normal((B, T, D)) / np.sqrt(T)).astype(np.float32)
    positions = (np.arange(T)[None, :] + np.array([[0], [5]])).astype(np.int32)  # absolute, per row
    return x, r, positions


# --------------------------------------------------------------------------------------------
# Zig-zag layout


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zigzag_layout_round_trip(p):
    x = np.random.default_rng(p).standard_normal((B, T, 3)).astype(np.float32)
    order = cp.zigzag_order(T, p)
    assert sorted(order) == list(range(T))
    with jax.set_mesh(make_mesh(MESHES[p])):
        zz = jax.jit(cp.to_zigzag)(x)
        back = jax.jit(cp.from_zigzag)(zz)
    np.testing.assert_array_equal(np.asarray(zz), x[:, order])
    np.testing.assert_array_equal(np.asarray(back), x)
    # Balanced: with causal visibility each shard's queries see the same number of keys.
    chunks = np.asarray(order).reshape(p, T // p)
    work = [(c[:, None] >= np.arange(T)[None, :]).sum() for c in chunks]
    assert len(set(work)) == 1, work


def test_zigzag_refuses_indivisible_length():
    with jax.set_mesh(make_mesh(MESHES[4])):
        with pytest.raises(ValueError, match=r"length 44, .*multiple of 8"):
            cp.to_zigzag(jnp.zeros((B, 44, 3)))


# --------------------------------------------------------------------------------------------
# Ring MLA


@pytest.mark.parametrize("p", [8])
def test_ring_attention_function_matches_dense_reference(p):
    """The ring on its own, with small blocks so visibility skipping happens inside each step;
    queries and keys in different (shuffled) orders: visibility is by position only."""
    N, Hn, R, C, V = 2, 5, 4, 11, 7
    ks = jax.random.split(jax.random.key(p), 6)
    q = jax.random.normal(ks[0], (B, T, N, Hn + R))
    c_kv = jax.random.normal(ks[1], (B, T, C))
    k_rope = jax.random.normal(ks[2], (B, T, R))
    kv_b = jax.random.normal(ks[3], (C, N, Hn + V)) / np.sqrt(C)
    cot = jax.random.normal(ks[4], (B, T, N, V))
    q_pos = jax.random.permutation(ks[5], jnp.arange(T, dtype=jnp.int32))[None].repeat(B, 0) + jnp.array([[0], [3]])
    kv_pos = jnp.arange(T, dtype=jnp.int32)[None].repeat(B, 0) + jnp.array([[0], [3]])

    def reference(q, c_kv, k_rope, kv_b):
        kv = jnp.einsum("BSC,CNH->BSNH", c_kv, kv_b)
        k = jnp.concatenate([kv[..., :Hn], jnp.broadcast_to(k_rope[:, :, None], (B, T, N, R))], -1)
        return attention_reference(q, k, kv[..., Hn:], q_pos, kv_pos, 0.3)

    def ring(q, c_kv, k_rope, kv_b):
        return ring_mla_attention(q, c_kv, k_rope, kv_b, q_pos, kv_pos, 0.3, nope_dim=Hn, block_q=4, block_k=3)

    def value_and_grads(fn):
        loss = lambda *a: jnp.sum(fn(*a) * cot)  # noqa: E731
        return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(q, c_kv, k_rope, kv_b)

    want = value_and_grads(reference)
    with jax.set_mesh(make_mesh(MESHES[p])):
        got = value_and_grads(ring)
    _assert_close(got, want)


def _mla_cfg():
    mla = MLAConfig(num_heads=2, q_lora_rank=13, kv_lora_rank=11, qk_nope_head_dim=5, qk_rope_head_dim=4, v_head_dim=7)
    rope = RopeConfig(type="yarn", factor=4.0, original_max_position=16, mscale=0.7, mscale_all_dim=1.0)
    return ModelConfig(d_model=D, mla=mla, rope=rope)


@functools.cache
def _mla() -> MLA:
    module = MLA(_mla_cfg(), rngs=nnx.Rngs(0))
    # Unit-scale projections so attention is far from uniform and the comparison means something.
    for _, v in nnx.iter_graph(module):
        if isinstance(v, nnx.Param) and v[...].ndim > 1:
            v[...] = v[...] * (1.0 / (0.02 * np.sqrt(v[...].shape[0])))
    return module


def _collectives(module, x, positions) -> str:
    """The forward's jaxpr as text: shows which collectives the path under the current mesh uses."""
    graphdef, state = nnx.split(module)
    return str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, positions))(state, x))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_mla_layer_context_parallel_equals_local(p):
    module = _mla()
    x, r, positions = _inputs(p)
    want = _run(module, x, positions, r)
    with jax.set_mesh(make_mesh(MESHES[p])):
        assert "ppermute" in _collectives(module, x, positions)  # the ring, not GSPMD's choice
        got = _run(module, x, positions, r)
    assert "ppermute" not in _collectives(module, x, positions)
    _assert_close(got, want)


# --------------------------------------------------------------------------------------------
# KDA


@functools.cache
def _kda() -> KDA:
    cfg = ModelConfig(d_model=D, kda=KDAConfig(num_heads=2, head_dim=7, conv_kernel=4, chunk_size=5))
    module = KDA(cfg, rngs=nnx.Rngs(1))
    for path, v in nnx.iter_graph(module):
        if not isinstance(v, nnx.Param):
            continue
        name = path[-1]
        if name in ("q", "k", "v", "f_a", "b", "g_a", "o", "f_b", "g_b"):
            v[...] = v[...] * (1.0 / (0.02 * np.sqrt(v[...].shape[0])))
        elif name.endswith("_conv"):
            v[...] = v[...] * 25.0  # 0.5-scale taps
        elif name == "A_log":
            v[...] = v[...] - 2.0  # slower decay: the state carries across shard boundaries
    return module


@pytest.mark.parametrize("p", [2, 4, 8])
def test_kda_layer_context_parallel_equals_local(p):
    module = _kda()
    x, r, positions = _inputs(p)
    want = _run(module, x, positions, r)
    with jax.set_mesh(make_mesh(MESHES[p])):
        jaxpr = _collectives(module, x, positions)
        assert "ppermute" in jaxpr and "all_gather" in jaxpr  # conv halo, boundary states
        got = _run(module, x, positions, r)
    _assert_close(got, want)


_forward_with_state = _jit(lambda m, x, state: m.forward_with_state(x, state))


@pytest.mark.parametrize("p", [4])
def test_kda_context_parallel_continues_from_a_state(p):
    """A prefill continuing from a non-zero conv and recurrent state returns the same output and
    the same state after the last token (the last shard's), on every shard."""
    module = _kda()
    x, _, _ = _inputs(10 + p)
    rng = np.random.default_rng(p)
    state = KDAState(
        conv=rng.standard_normal((B, 3, 3, 2, 7)).astype(np.float32),
        recurrent=(0.3 * rng.standard_normal((B, 2, 7, 7))).astype(np.float32),
    )
    want = _forward_with_state(module, x, state)
    with jax.set_mesh(make_mesh(MESHES[p])):
        got = _forward_with_state(module, x, state)
    _assert_close(got, want)


def test_kda_refuses_short_shards():
    module = _kda()
    x = jnp.zeros((B, 16, D))  # 2 tokens a shard on 8 shards; the conv halo needs 3
    with jax.set_mesh(make_mesh(MESHES[8])):
        with pytest.raises(ValueError, match=r"2 tokens per 'context' shard.*conv_kernel - 1 = 3"):
            module(x, None)
