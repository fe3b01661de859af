"""Expert parallelism: every dispatch path against the dense reference, forward and gradient.

fp32, tolerance 1e-5, seeds 0-2, on meshes with 8 experts-way, 2 data x 4 expert, and 2 x 2 x 2
with fsdp or tensor. D=14 and F=6 are even because fsdp splits D and tensor splits F; tokens
(8 x 5) and experts (E=16, K=3) are otherwise odd-sized so a transposed block cannot hide.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jaxmoe.config import Config, ConfigError, MeshConfig, ModelConfig, MoEConfig, from_config_dict, validate
from jaxmoe.moe import MoE, MoEStats, ragged_plan, reference_experts, reference_moe
from jaxmoe.moe import expert_parallel as ep
from jaxmoe.sharding import logical_to_spec, make_mesh, state_shardings

TOL = dict(rtol=1e-5, atol=1e-5)
D, E, K, F = 14, 16, 3, 6
B, T = 8, 5
SEEDS = (0, 1, 2)

MESHES = {
    "expert8": MeshConfig(expert=8),
    "data2_expert4": MeshConfig(data=2, expert=4),
    "data2_fsdp2_expert2": MeshConfig(data=2, fsdp=2, expert=2),
    "data2_expert2_tensor2": MeshConfig(data=2, expert=2, tensor=2),
}


def _cfg(dispatch: str, capacity_factor: float = 1.25) -> ModelConfig:
    cfg = ModelConfig(
        d_model=D,
        init_std=0.3,
        moe=MoEConfig(
            num_experts=E,
            experts_per_token=K,
            num_groups=4,
            topk_groups=2,
            expert_ffw_dim=F,
            num_shared_experts=1,
            routed_scaling_factor=2.5,
            dispatch=dispatch,
            capacity_factor=capacity_factor,
        ),
    )
    for mesh in MESHES.values():
        validate(Config(model=cfg, mesh=mesh))
    return cfg


def _graphdef(cfg: ModelConfig):
    return nnx.graphdef(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))


def _state(seed: int, bias=None):
    """Parameters drawn by numpy (no init compiles); a random selection bias, expert ``seed`` never chosen."""
    moe = nnx.eval_shape(lambda: MoE(_cfg("dense"), rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for _, v in nnx.iter_graph(moe):
        if isinstance(v, nnx.Variable):
            abstract = v.get_value()
            v.set_value(jnp.asarray(0.3 * rng.normal(size=abstract.shape), abstract.dtype))
    if bias is None:
        bias = rng.uniform(-0.3, 0.3, size=E).astype(np.float32)
        bias[seed] = -10.0  # an expert with no tokens: an empty group on its shard
    moe.router_bias[...] = jnp.asarray(bias)
    return nnx.state(moe)


def _inputs(seed: int, b: int = B):
    rng = np.random.default_rng(100 + seed)
    x = jnp.asarray(rng.normal(size=(b, T, D)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(b, T, D)), jnp.float32)
    return x, r


def _fwd_bwd(fn):
    @functools.partial(jax.jit, static_argnums=0)
    def run(graphdef, state, x, r):
        def loss(state, x):
            y, stats = fn(nnx.merge(graphdef, state), x)
            return jnp.sum(y * r), (y, stats)

        (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return y, stats, grads

    return run


_model_fwd_bwd = _fwd_bwd(lambda m, x: m.call_with_stats(x))
_reference_fwd_bwd = _fwd_bwd(lambda m, x: (reference_moe(m, x), None))


@_fwd_bwd
def _masked_reference_fwd_bwd(m, xk):
    """The reference with the assignments outside ``keep`` removed (what capacity dropping means)."""
    x, keep = xk
    x_flat = x.reshape(-1, D)
    weights, indices, _ = m.route(x_flat)
    y = reference_experts(x_flat, weights * keep, indices, m.w_gate[...], m.w_up[...], m.w_down[...])
    return y.reshape(x.shape) + m.shared(x), None


@functools.cache
def _reference(seed: int):
    """Unsharded reference output and gradients: (y, (grad state, grad x))."""
    x, r = _inputs(seed)
    y, _, grads = _reference_fwd_bwd(_graphdef(_cfg("dense")), _state(seed), x, r)
    return jax.device_get((y, grads))


def _run_sharded(mesh, cfg, state, x, r, fwd_bwd=_model_fwd_bwd):
    with jax.set_mesh(mesh):
        state = jax.device_put(state, state_shardings(state, mesh))
        spec = logical_to_spec(("batch", "seq", "act_embed"))
        # An uneven batch is left for jit to place (device_put refuses a batch 8 devices cannot split).
        xs = jax.device_put(x, NamedSharding(mesh, spec)) if x.shape[0] % 8 == 0 else x
        y, stats, grads = fwd_bwd(_graphdef(cfg), state, xs, r)
    return jax.device_get((y, stats, grads))


def _assert_same(got, want):
    y, (gs, gx) = got
    y_ref, (gs_ref, gx_ref) = want
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(gx, gx_ref, **TOL)
    flat, flat_ref = dict(nnx.to_flat_state(gs)), dict(nnx.to_flat_state(gs_ref))
    assert set(flat) == set(flat_ref)
    assert {p[-1] for p in flat} >= {"router", "w_gate", "w_up", "w_down", "gate", "up", "down"}
    for path, g in flat.items():
        np.testing.assert_allclose(g[...], flat_ref[path][...], err_msg=str(path), **TOL)


def _routing(seed: int, state=None, x=None):
    """The router's choice for ``seed``'s inputs: ``(weights [N, K], indices [N, K])`` numpy."""
    moe = nnx.merge(_graphdef(_cfg("dense")), _state(seed) if state is None else state)
    x = _inputs(seed)[0] if x is None else x
    weights, indices, _ = moe.route(x.reshape(-1, D))
    return np.asarray(weights), np.asarray(indices)


def _token_shards(mesh_cfg: MeshConfig) -> int:
    return mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.expert * mesh_cfg.context


@pytest.fixture(params=sorted(MESHES), ids=sorted(MESHES))
def ep_mesh(request):
    return request.param, make_mesh(MESHES[request.param])


# ------------------------------------------------------------------------------------------
# Dropless paths == dense reference


def _check_dropless(dispatch: str, mesh) -> None:
    cfg = _cfg(dispatch)
    for seed in SEEDS:
        x, r = _inputs(seed)
        y, stats, grads = _run_sharded(mesh, cfg, _state(seed), x, r)
        _assert_same((y, grads), _reference(seed))
        _, indices = _routing(seed)
        np.testing.assert_array_equal(stats.expert_load, np.bincount(indices.ravel(), minlength=E))
        assert stats.expert_load[seed] == 0 and int(stats.dropped) == 0 and float(stats.drop_fraction) == 0.0


def test_dropless_matches_reference(ep_mesh):
    _check_dropless("dropless", ep_mesh[1])


@pytest.mark.parametrize("mesh_name", ["expert8", "data2_expert2_tensor2"])
def test_ragged_matches_reference_with_emulated_exchange(mesh_name, monkeypatch):
    # The production path, with only the collective replaced by its slow CPU reference: the
    # offsets and sizes of ragged_plan decide where every row goes and comes back.
    monkeypatch.setattr(ep, "_xla_ragged_all_to_all", ep.emulate_ragged_all_to_all)
    _check_dropless("ragged", make_mesh(MESHES[mesh_name]))


def test_capacity_matches_reference_when_capacity_suffices(ep_mesh):
    # capacity_factor = E / K gives C = n slots: every assignment of a shard fits.
    name, mesh = ep_mesh
    n = B * T // _token_shards(MESHES[name])
    cfg = _cfg("capacity", capacity_factor=E / K)
    assert ep.capacity(n, cfg.moe) == n
    for seed in SEEDS:
        x, r = _inputs(seed)
        y, stats, grads = _run_sharded(mesh, cfg, _state(seed), x, r)
        _assert_same((y, grads), _reference(seed))
        assert int(stats.dropped) == 0


# ------------------------------------------------------------------------------------------
# Capacity: drops exactly counted, and exactly the right ones


def _numpy_capacity_keep(indices: np.ndarray, n: int, C: int) -> np.ndarray:
    """Per shard of ``n`` consecutive tokens, each expert keeps its first ``C`` assignments in
    k-major order (all first choices, then all second choices, ...; tokens in order)."""
    keep = np.zeros(indices.shape, bool)
    for start in range(0, indices.shape[0], n):
        used = np.zeros(E, int)
        for k in range(K):
            for t in range(start, start + n):
                e = indices[t, k]
                if used[e] < C:
                    keep[t, k] = True
                    used[e] += 1
    return keep


def _overflow_count(indices: np.ndarray, n: int, C: int) -> int:
    """Assignments over capacity, counted per (shard, expert): sum of max(count - C, 0)."""
    counts = np.stack([np.bincount(indices[s : s + n].ravel(), minlength=E) for s in range(0, indices.shape[0], n)])
    return int(np.maximum(counts - C, 0).sum())


@pytest.mark.parametrize("name", ["expert8", "data2_expert2_tensor2"])
def test_capacity_drops_exactly(name):
    mesh = make_mesh(MESHES[name])
    n = B * T // _token_shards(MESHES[name])
    cfg = _cfg("capacity", capacity_factor=0.5)
    C = ep.capacity(n, cfg.moe)
    seed = 1
    x, r = _inputs(seed)
    # Every token picks experts 0, 1, 2 (one group), so each shard overflows them by n - C; then
    # the random routing of the other tests, where only some experts overflow on some shards.
    forced = np.full(E, -5.0, np.float32)
    forced[:K] = 5.0
    for state, everything_to_three in ((_state(seed, bias=forced), True), (_state(seed), False)):
        _, indices = _routing(seed, state, x)
        keep = _numpy_capacity_keep(indices, n, C)
        expected = _overflow_count(indices, n, C)
        assert expected == int((~keep).sum()) > 0
        if everything_to_three:
            assert expected == (B * T // n) * K * (n - C)

        y, stats, grads = _run_sharded(mesh, cfg, state, x, r)
        assert int(stats.dropped) == expected
        np.testing.assert_allclose(stats.drop_fraction, expected / (B * T * K), rtol=1e-6)
        np.testing.assert_array_equal(stats.expert_load, np.bincount(indices.ravel(), minlength=E))

        keep_arr = jnp.asarray(keep.astype(np.float32))
        y_ref, _, (gs_ref, (gx_ref, _)) = _masked_reference_fwd_bwd(_graphdef(cfg), state, (x, keep_arr), r)
        _assert_same((y, grads), jax.device_get((y_ref, (gs_ref, gx_ref))))


# ------------------------------------------------------------------------------------------
# ragged: the offset arithmetic, by a numpy exchange; the CPU error


def _numpy_ragged_all_to_all(operands, outputs, plans, L):
    """``jax.lax.ragged_all_to_all`` as its documentation defines it, over a list of shards.

    Rows are Python objects, so where each lands is checked exactly; a row written twice fails.
    """
    P = len(operands)
    results = [list(o) for o in outputs]
    written = [set() for _ in range(P)]
    for s, plan in enumerate(plans):
        for i in range(len(plan.send_sizes)):
            dst, size = i // L, int(plan.send_sizes[i])
            # The receiver expects exactly this many rows from s in this slice.
            assert int(plans[dst].recv_sizes[s * L + i % L]) == size
            start, out = int(plan.input_offsets[i]), int(plan.output_offsets[i])
            for j in range(size):
                assert out + j not in written[dst], "two slices write one row"
                written[dst].add(out + j)
                results[dst][out + j] = operands[s][start + j]
    return results


@pytest.mark.parametrize("P,L", [(1, 3), (2, 1), (4, 3), (8, 2)])
def test_ragged_plan_offsets(P, L):
    rng = np.random.default_rng(P * 10 + L)
    E_ = P * L
    for trial in range(4):
        counts = rng.integers(0, 4, size=(P, E_))
        counts[rng.random((P, E_)) < 0.3] = 0
        if trial == 0:
            counts[:, :] = 0
            counts[:, 0] = 3  # everything to one expert: the worst-case receive buffer
        A = int(counts.sum(1).max())
        plans = [ragged_plan(counts, p) for p in range(P)]
        forward = [pl[0] for pl in plans]
        back = [pl[1] for pl in plans]
        operands = [[(s, e, j) for e in range(E_) for j in range(counts[s, e])] for s in range(P)]
        operands = [o + [None] * (A - len(o)) for o in operands]  # padded rows, never sent
        recv = _numpy_ragged_all_to_all(operands, [[None] * (P * A)] * P, forward, L)
        for p in range(P):
            want = [(s, p * L + l, j) for l in range(L) for s in range(P) for j in range(counts[s, p * L + l])]
            assert recv[p][: len(want)] == want  # grouped by local expert, sources in order
            assert all(v is None for v in recv[p][len(want) :])
            np.testing.assert_array_equal(plans[p][2], counts[:, p * L : (p + 1) * L].sum(0))
        # send_sizes == all_to_all(recv_sizes): the collective's precondition.
        for p in range(P):
            for q in range(P):
                np.testing.assert_array_equal(
                    forward[p].send_sizes[q * L : (q + 1) * L], forward[q].recv_sizes[p * L : (p + 1) * L]
                )
        returned = _numpy_ragged_all_to_all(recv, [[None] * A] * P, back, L)
        assert returned == operands


def test_ragged_on_cpu_raises():
    cfg = _cfg("ragged")
    x, _ = _inputs(0, b=2)
    moe = nnx.merge(_graphdef(cfg), _state(0))
    with pytest.raises(NotImplementedError, match=r"model.moe.dispatch='ragged'.*XLA:CPU"):
        nnx.eval_shape(lambda m, x: m(x), moe, x)  # raised while tracing: nothing compiles


# ------------------------------------------------------------------------------------------
# Padding, no mesh, stats through nnx.capture, config


def test_uneven_tokens_are_padded():
    # N = 3 * 5 = 15 tokens on 8 token shards: padded to 16; the padding routes to no expert.
    mesh = make_mesh(MESHES["expert8"])
    x, r = _inputs(2, b=3)
    state = _state(2)
    y_ref, _, g_ref = _reference_fwd_bwd(_graphdef(_cfg("dense")), state, x, r)
    # The capacity path: padding must neither take slots nor count as dropped or as load.
    y, stats, grads = _run_sharded(mesh, _cfg("capacity", capacity_factor=E / K), state, x, r)
    _assert_same((y, grads), jax.device_get((y_ref, g_ref)))
    assert int(stats.expert_load.sum()) == 15 * K and int(stats.dropped) == 0


def test_no_mesh_runs_on_one_device():
    x, r = _inputs(0)
    y, stats, grads = _model_fwd_bwd(_graphdef(_cfg("dropless")), _state(0), x, r)
    _assert_same((y, grads), _reference(0))
    assert int(stats.expert_load.sum()) == B * T * K


@nnx.jit
def _plain_and_with_stats(moe, x):
    return moe(x), moe.call_with_stats(x)


@nnx.jit
def _captured(moe, x):
    return nnx.capture(moe, nnx.Intermediate)(x)


def test_stats_sown_under_capture_only():
    cfg = _cfg("capacity", capacity_factor=0.5)
    moe = nnx.merge(_graphdef(cfg), _state(1))
    x, _ = _inputs(1)
    before = nnx.graphdef(moe)
    y_plain, (_, want) = _plain_and_with_stats(moe, x)
    assert nnx.graphdef(moe) == before, "a plain call must not add variables to the module"

    y, inter = _captured(moe, x)
    (stats,) = inter["moe_stats"].get_value()  # one entry per call
    assert isinstance(stats, MoEStats)
    np.testing.assert_array_equal(y, y_plain)
    assert int(stats.dropped) == int(want.dropped) > 0
    np.testing.assert_array_equal(stats.expert_load, want.expert_load)
    assert nnx.graphdef(moe) == before


def test_capacity_factor_config():
    d = {"model": {"moe": {"capacity_factor": 0.0}}}
    with pytest.raises(ConfigError, match="model.moe.capacity_factor"):
        from_config_dict(d)
    assert (
        from_config_dict({"model": {"moe": {"dispatch": "capacity", "capacity_factor": 2}}}).model.moe.capacity_factor
        == 2.0
    )
    moe = dataclasses.replace(_cfg("capacity").moe, capacity_factor=1.0)
    assert ep.capacity(40, moe) == math.ceil(40 * K / E)
    assert ep.capacity(1, moe) == 1


def test_experts_not_divisible_by_expert_axis():
    cfg = dataclasses.replace(_cfg("dropless"), moe=dataclasses.replace(_cfg("dropless").moe, num_experts=12))
    mesh = make_mesh(MESHES["expert8"])
    moe = nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="num_experts=12"):
        jax.eval_shape(lambda m, x: m(x), moe, x)


# ------------------------------------------------------------------------------------------
# MXFP4 expert weights cross into the region packed


@functools.partial(jax.jit, static_argnums=0)
def _param_fwd_bwd(graphdef, params, rest, x, r):
    """Like ``_model_fwd_bwd``, differentiating the ``nnx.Param`` only (packed MXFP4 data is frozen)."""

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest).call_with_stats(x)
        return jnp.sum(y * r), (y, stats)

    (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, stats, grads


def test_mxfp4_expert_weights():
    # D and F multiples of 32 x (fsdp, tensor): the packed blocks split along with the weights.
    d, f = 64, 64
    cfg = ModelConfig(
        d_model=d,
        init_std=0.3,
        mxfp4_weights=("w_gate", "w_up", "w_down"),
        moe=MoEConfig(
            num_experts=E, experts_per_token=K, num_groups=4, topk_groups=2, expert_ffw_dim=f, num_shared_experts=0
        ),
    )
    mesh_cfg = MeshConfig(fsdp=2, expert=2, tensor=2)
    validate(Config(model=cfg, mesh=mesh_cfg))
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.router_bias[...] = jnp.asarray(np.random.default_rng(0).uniform(-0.3, 0.3, size=E), jnp.float32)
    _, params, rest = nnx.split(moe, nnx.Param, ...)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(B, T, d)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(B, T, d)), jnp.float32)
    # The dense path on one device (its own MXFP4 tests hold it to the dequantized reference).
    want = jax.device_get(_param_fwd_bwd(nnx.graphdef(moe), params, rest, x, r))
    mesh = make_mesh(mesh_cfg)
    for dispatch, factor in (("dropless", 1.25), ("capacity", E / K)):
        c = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch=dispatch, capacity_factor=factor))
        graphdef = nnx.graphdef(nnx.eval_shape(lambda c=c: MoE(c, rngs=nnx.Rngs(0))))
        with jax.set_mesh(mesh):
            p, q = (jax.device_put(s, state_shardings(s, mesh)) for s in (params, rest))
            y, stats, (gs, gx) = jax.device_get(_param_fwd_bwd(graphdef, p, q, x, r))
        np.testing.assert_allclose(y, want[0], err_msg=dispatch, **TOL)
        np.testing.assert_allclose(gx, want[2][1], err_msg=dispatch, **TOL)
        np.testing.assert_allclose(gs["router"][...], want[2][0]["router"][...], err_msg=dispatch, **TOL)
        assert int(stats.dropped) == 0
