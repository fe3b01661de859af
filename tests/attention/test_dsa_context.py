"""Streamed and context-parallel DSA (``jaxmoe.attention.dsa_context``) against the dense reference.

- The streamed top-K picks the same sets (and scores) as ``top_k`` over the dense ``[B, T, S]``
  scores, through every merge bucket and the group pre-filter (small blocks force them).
- ``DSA.__call__`` (streamed) equals the dense ``select`` + ``sparse_attention``, forward and
  gradient with respect to the input and every parameter.
- Context-parallel over 2, 4 and 8 shards equals the unsharded layer, forward and gradient.
- The indexer's sparse-stage KL loss from the streamed selection equals the one from the dense
  reference, value and indexer gradients, on one device and context-parallel.
- Neither path, nor the loss, builds an array with a query and a key dimension (jaxpr and
  compiled HLO), while the same check finds the dense reference's ``[B, T, S]``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.attention.dsa import DSA
from jaxmoe.attention.dsa_context import DSABlocks, streamed_topk
from jaxmoe.attention.dsa_topk import index_scores
from jaxmoe.config import IndexerConfig, MeshConfig, MLAConfig, ModelConfig
from jaxmoe.sharding import make_mesh
from jaxmoe.train.dsa_loss import indexer_kl_loss, kl_to_target

ATOL = 1e-5
B, T, TOPK = 2, 152, 24  # T = 8 * 19: odd local lengths on every ring
D, N, NOPE, ROPE, V, C, Q = 24, 3, 6, 4, 5, 11, 13
NI, HI = 16, 11  # many indexer heads: a score is exactly 0 (all heads relu-ed away) rarely
# Small blocks so every path runs: several chunks, key blocks and buckets; grouped and direct merges.
SMALL = DSABlocks(query_chunk=24, block_q=8, block_k=12, group=3, attn_block_q=4, append=2, buffer=2)


def _cfg(topk=TOPK):
    return ModelConfig(
        d_model=D,
        layer_kinds=("dsa",),
        mla=MLAConfig(N, Q, C, NOPE, ROPE, V),
        indexer=IndexerConfig(num_heads=NI, head_dim=HI, topk=topk),
        init_std=0.3,
    )


def _model(seed, blocks=SMALL):
    model = DSA(_cfg(), rngs=nnx.Rngs(seed))
    model.blocks = blocks
    return model


def _inputs(seed, t=T):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, t, D)).astype(np.float32)
    cot = rng.standard_normal((B, t, D)).astype(np.float32)
    positions = (np.arange(t)[None, :] + np.array([[0], [5]])).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(cot), jnp.asarray(positions)


def _dense_scores(model, x, positions):
    return model.indexer(x, model.query_latent(x), positions)


def _assert_no_boundary_ties(scores, k):
    """A tie at the K-th score would make 'the' top-K set ambiguous: the seed must avoid one."""
    s = np.sort(np.asarray(scores), axis=-1)[..., ::-1]
    kth, nxt = s[..., k - 1], s[..., k]
    tie = np.isfinite(nxt) & (kth - np.where(np.isfinite(nxt), nxt, 0) <= 1e-6)
    assert not tie.any(), f"top-k tie at {np.argwhere(tie)[:3]}: pick another seed"


@functools.partial(jax.jit, static_argnums=0)
def _topk_run(graphdef, state, x, positions):
    model = nnx.merge(graphdef, state)
    q_latent = model.query_latent(x)
    q, w = model.indexer.query_terms(x, q_latent, positions)
    k = model.indexer.keys(x, positions)
    streamed = streamed_topk(q, w, positions, k, positions, topk=TOPK, blocks=SMALL)
    scores = _dense_scores(model, x, positions)
    return streamed, scores, model.indexer.select(scores, positions)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_topk_equals_dense_topk(seed):
    model = _model(seed)
    x, _, positions = _inputs(seed)

    graphdef, state = nnx.split(model)
    (vals, idx, valid), scores, (ref_idx, ref_valid) = jax.tree.map(
        np.asarray, _topk_run(graphdef, state, x, positions)
    )
    _assert_no_boundary_ties(scores, TOPK)
    for b in range(B):
        for t in range(T):
            want = {int(s) for s, ok in zip(ref_idx[b, t], ref_valid[b, t]) if ok}
            have = {int(s) for s, ok in zip(idx[b, t], valid[b, t]) if ok}
            assert have == want, (b, t)
            assert len(have) == min(t + 1, TOPK)
    # The running values are the dense scores of the selected keys (blocked matmuls round differently).
    picked = np.take_along_axis(scores, np.where(valid, idx, 0), axis=-1)
    np.testing.assert_allclose(np.where(valid, vals, 0), np.where(valid, picked, 0), atol=ATOL, rtol=0)


# Each path of the selection alone: every query's candidates fit the buffer; refinement rounds
# with the exact K-th of the buffer from the start (rounds=0); 16-bit refinements first.
PATHS = {
    "fits": DSABlocks(query_chunk=24, block_q=8, block_k=12, group=3, attn_block_q=4, append=2, buffer=7),
    "exact_refinement": DSABlocks(
        query_chunk=16, block_q=8, block_k=16, group=4, attn_block_q=4, append=4, buffer=2, rounds=0
    ),
    "refined": DSABlocks(
        query_chunk=32, block_q=16, block_k=24, group=2, attn_block_q=8, append=2, buffer=2, rounds=50
    ),
}


def _topk_sets(vals, idx, valid):
    return [[{int(s) for s, ok in zip(idx[b, t], valid[b, t]) if ok} for t in range(idx.shape[1])] for b in range(B)]


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_selection_path_equals_dense_topk(path):
    model = _model(3)
    x, _, positions = _inputs(3)
    q_latent = model.query_latent(x)
    q, w = model.indexer.query_terms(x, q_latent, positions)
    k = model.indexer.keys(x, positions)
    scores = np.asarray(_dense_scores(model, x, positions))
    _assert_no_boundary_ties(scores, TOPK)
    got = jax.jit(functools.partial(streamed_topk, topk=TOPK, blocks=PATHS[path]))(q, w, positions, k, positions)
    got = jax.tree.map(np.asarray, got)
    ref = jax.tree.map(np.asarray, model.indexer.select(jnp.asarray(scores), positions))
    assert _topk_sets(*got) == _topk_sets(None, *ref)


def test_ties_take_the_lowest_positions():
    """Scores quantised to a few values: many ties at the K-th score, resolved as top_k does (lower index)."""
    rng = np.random.default_rng(0)
    t, nh, hd = 96, 2, 4
    q = jnp.asarray(rng.integers(0, 2, (B, t, nh, hd)).astype(np.float32))
    k = jnp.asarray(rng.integers(0, 2, (B, t, hd)).astype(np.float32))
    w = jnp.ones((B, t, nh), jnp.float32)
    positions = jnp.asarray(np.broadcast_to(np.arange(t, dtype=np.int32), (B, t)))
    scores = index_scores(q, w, k, positions, positions)
    for blocks in PATHS.values():
        got = jax.tree.map(np.asarray, streamed_topk(q, w, positions, k, positions, topk=TOPK, blocks=blocks))
        _, ref_idx = jax.lax.top_k(scores, TOPK)
        ref_valid = (
            np.take_along_axis(np.asarray(positions)[:, None, :], np.asarray(ref_idx), axis=-1)
            <= np.asarray(positions)[:, :, None]
        )
        assert _topk_sets(*got) == _topk_sets(None, np.asarray(ref_idx), ref_valid)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _value_and_grads(graphdef, state, x, cot, positions, dense):
    def f(state, x):
        m = nnx.merge(graphdef, state)
        if dense:
            indices, valid = m.select(x, positions)
            y, _ = m.sparse_attention(x, positions, indices, valid)
        else:
            y = m(x, positions)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(state, x)
    return y, grads


def _loss_and_grads(model, x, cot, positions, dense: bool):
    """Output, input gradient and parameter gradients; one compilation per (path, mesh)."""
    graphdef, state = nnx.split(model)
    y, (g_state, g_x) = _value_and_grads(graphdef, state, x, cot, positions, dense)
    # Parameter gradients of the loss per token (as a mean loss trains), so they are O(1), not O(B T).
    g_params = {k: np.asarray(v) / (B * x.shape[1]) for k, v in nnx.to_flat_state(g_state)}
    return np.asarray(y), np.asarray(g_x), g_params


def _assert_close(got, want):
    y, g_x, g_params = got
    y_ref, g_x_ref, g_params_ref = want
    np.testing.assert_allclose(y, y_ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(g_x, g_x_ref, atol=ATOL, rtol=0)
    assert g_params.keys() == g_params_ref.keys()
    for name in g_params:
        np.testing.assert_allclose(g_params[name], g_params_ref[name], atol=ATOL, rtol=0, err_msg=str(name))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_layer_equals_dense_reference(seed):
    model = _model(seed)
    x, cot, positions = _inputs(seed)
    _assert_no_boundary_ties(_dense_scores(model, x, positions), TOPK)
    got = _loss_and_grads(model, x, cot, positions, dense=False)
    want = _loss_and_grads(model, x, cot, positions, dense=True)
    assert np.abs(want[0]).max() > 0.1 and np.abs(want[1]).max() > 0.1
    assert min(np.abs(want[2][(name,)]).max() for name in ("q_a", "q_b", "kv_a", "kv_b", "o")) > 1e-3
    _assert_close(got, want)


MESHES = {
    2: MeshConfig(data=2, context=2, tensor=2),
    4: MeshConfig(data=2, context=4),
    8: MeshConfig(context=8),
}


@pytest.mark.parametrize("context", sorted(MESHES))
def test_context_parallel_equals_unsharded(context):
    seed = context  # a different model and input per ring size
    model = _model(seed)
    x, cot, positions = _inputs(seed)
    _assert_no_boundary_ties(_dense_scores(model, x, positions), TOPK)
    want = _loss_and_grads(model, x, cot, positions, dense=False)
    with jax.set_mesh(make_mesh(MESHES[context])):
        got = _loss_and_grads(model, x, cot, positions, dense=False)
    _assert_close(got, want)


# --------------------------------------------------------------------------------------------
# The indexer's sparse-stage loss


def _dense_sparse_stage_loss(m, x, positions):
    """The sparse-stage KL from the dense reference: ``[B, T, S]`` scores, ``top_k``, gathered attention."""
    x = jax.lax.stop_gradient(x)
    q_latent = jax.lax.stop_gradient(m.query_latent(x))
    scores = m.indexer(x, q_latent, positions)
    indices, valid = m.indexer.select(scores, positions)
    _, probs = m.sparse_attention(x, positions, indices, valid, q_latent)
    target = jnp.sum(jax.lax.stop_gradient(probs), axis=2)
    target /= jnp.sum(target, axis=-1, keepdims=True)
    return jnp.mean(kl_to_target(target, jnp.take_along_axis(scores, indices, axis=-1), valid))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _indexer_loss_and_grads(graphdef, state, x, positions, dense):
    def f(state):
        m = nnx.merge(graphdef, state)
        return _dense_sparse_stage_loss(m, x, positions) if dense else indexer_kl_loss(m, x, positions, sparse=True)

    return jax.value_and_grad(f)(state)


def _indexer_loss(model, x, positions, dense):
    graphdef, state = nnx.split(model)
    loss, grads = _indexer_loss_and_grads(graphdef, state, x, positions, dense)
    return float(loss), {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}


def _assert_same_indexer_loss(got, want):
    assert got[1].keys() == want[1].keys()
    np.testing.assert_allclose(got[0], want[0], atol=ATOL, rtol=0)
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], atol=ATOL, rtol=0, err_msg=str(name))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_indexer_loss_equals_dense(seed):
    model = _model(seed)
    w = model.indexer.weights_proj
    w[...] = w[...] * 4.0  # sharper index scores: a KL of O(1), so the tolerance is demanding
    x, _, positions = _inputs(seed)
    _assert_no_boundary_ties(_dense_scores(model, x, positions), TOPK)
    want = _indexer_loss(model, x, positions, dense=True)
    got = _indexer_loss(model, x, positions, dense=False)
    assert want[0] > 0.1
    indexer = [name for name in want[1] if name[0] == "indexer"]
    assert indexer and min(np.abs(want[1][name]).max() for name in indexer) > 1e-4
    assert all(np.all(g == 0) for name, g in want[1].items() if name[0] != "indexer")
    _assert_same_indexer_loss(got, want)


@pytest.mark.parametrize("context", sorted(MESHES))
def test_context_parallel_indexer_loss_equals_unsharded(context):
    model = _model(10 + context)
    x, _, positions = _inputs(10 + context)
    _assert_no_boundary_ties(_dense_scores(model, x, positions), TOPK)
    want = _indexer_loss(model, x, positions, dense=False)
    with jax.set_mesh(make_mesh(MESHES[context])):
        got = _indexer_loss(model, x, positions, dense=False)
    assert want[0] > 0.01
    _assert_same_indexer_loss(got, want)


def test_context_parallel_length_must_divide():
    model = _model(0)
    x, _, positions = _inputs(0, t=T - 1)
    with jax.set_mesh(make_mesh(MESHES[8])), pytest.raises(ValueError, match="q_cat has sequence length 151"):
        jax.eval_shape(lambda x, p: model(x, p), x, positions)


# --------------------------------------------------------------------------------------------
# No [T, S] array


def _jaxpr_shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            for sub in p if isinstance(p, list | tuple) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _jaxpr_shapes(inner)


def _hlo_shapes(text):
    for dims in re.findall(r"\b(?:f32|f16|bf16|s32|u32|s8|u8|pred|s64|u64)\[([0-9,]*)\]", text):
        yield tuple(int(d) for d in dims.split(",") if d)


def _query_by_key(shapes, t, s):
    """Shapes with a dimension >= t and another >= s (a [T, S] array, whatever else it has)."""
    out = set()
    for shape in shapes:
        big_t = [i for i, d in enumerate(shape) if d >= t]
        big_s = [i for i, d in enumerate(shape) if d >= s]
        if any(i != j for i in big_t for j in big_s):
            out.add(shape)
    return out


LONG = 2048  # T = S, longer than every other dimension of the layer


def _long_setup():
    model = DSA(_cfg(topk=64), rngs=nnx.Rngs(0))
    model.blocks = DSABlocks(query_chunk=128, block_q=32, block_k=128, group=8, attn_block_q=16, append=4)
    x = jax.ShapeDtypeStruct((1, LONG, D), jnp.float32)
    positions = jax.ShapeDtypeStruct((1, LONG), jnp.int32)
    graphdef, state = nnx.split(model)

    def forward(state, x, positions):
        return nnx.merge(graphdef, state)(x, positions)

    def grad(state, x, positions):
        return jax.grad(lambda s, x: jnp.sum(forward(s, x, positions)), argnums=(0, 1))(state, x)

    def indexer_loss_grad(state, x, positions):
        return jax.grad(lambda s: indexer_kl_loss(nnx.merge(graphdef, s), x, positions, sparse=True))(state)

    return model, state, x, positions, forward, grad, indexer_loss_grad


@pytest.mark.parametrize("context", [1, 8])
def test_no_query_by_key_array(context):
    _, state, x, positions, forward, grad, indexer_loss_grad = _long_setup()
    mesh = make_mesh(MESHES[8] if context == 8 else MeshConfig(data=8))
    with jax.set_mesh(mesh):
        for fn in (forward, grad, indexer_loss_grad):
            jaxpr = jax.make_jaxpr(fn)(state, x, positions).jaxpr
            assert not _query_by_key(_jaxpr_shapes(jaxpr), LONG, LONG), fn.__name__
        hlo = jax.jit(forward).lower(state, x, positions).compile().as_text()
        shapes = set(_hlo_shapes(hlo))
        assert not _query_by_key(shapes, LONG, LONG)
        if context == 8:  # per-device shapes: a shard's queries and keys never meet in one array either
            assert not _query_by_key(shapes, LONG // 8, LONG // 8)


def test_check_finds_the_dense_reference():
    model, state, x, positions, *_ = _long_setup()
    graphdef = nnx.graphdef(model)

    def dense(state, x, positions):
        m = nnx.merge(graphdef, state)
        return m.sparse_attention(x, positions, *m.select(x, positions))[0]

    jaxpr = jax.make_jaxpr(dense)(state, x, positions).jaxpr
    assert (1, LONG, LONG) in _query_by_key(_jaxpr_shapes(jaxpr), LONG, LONG)
