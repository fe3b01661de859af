"""grouped_matmul: "blocked" == jax.lax.ragged_dot == a numpy loop, forward and gradients wrt x and w.

fp32, tolerance 1e-5, seeds 0, 1, 2. Odd dimensions (M=37, I=11, O=13); group sizes drawn per
seed for a fixed shape, so the seeds share one compilation per (case, impl, block).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.moe import grouped
from jaxmoe.moe.grouped import default_block, grouped_matmul

TOL = dict(rtol=1e-5, atol=1e-5)
M, I, O = 37, 11, 13
BLOCKS = (1, 3, 8, 64, None)  # 64 > M: one tile per group, its window shifted back inside [0, M)


def _sizes(case: str, rng: np.random.Generator) -> np.ndarray:
    """``[E]`` int32 group sizes for ``case``; they sum to M except in "beyond" and "all_empty"."""
    if case == "odd":  # E=5, every group non-empty
        return (1 + rng.multinomial(M - 5, np.ones(5) / 5)).astype(np.int32)
    if case == "empty":  # E=7, the first, a middle and the last group empty
        sizes = np.zeros(7, np.int32)
        sizes[[1, 2, 4, 5]] = rng.multinomial(M, np.ones(4) / 4)
        return sizes
    if case == "one_group":  # E=4, all rows in one group
        sizes = np.zeros(4, np.int32)
        sizes[rng.integers(4)] = M
        return sizes
    if case == "beyond":  # E=6, the last rows belong to no group
        return rng.multinomial(M - 9, np.ones(6) / 6).astype(np.int32)
    if case == "all_empty":
        return np.zeros(3, np.int32)
    raise ValueError(case)


def _numpy_reference(x, w, sizes, dy):
    """``(y, dx, dw)`` in float64 by a loop over groups; ``dy`` is the output cotangent."""
    x, w, dy = (a.astype(np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        y[rows] = x[rows] @ w[e]
        dx[rows] = dy[rows] @ w[e].T
        dw[e] = x[rows].T @ dy[rows]
        start += n
    return y, dx, dw


@jax.jit(static_argnames=("impl", "block"))
def _fwd_bwd(x, w, sizes, dy, *, impl, block):
    y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, impl=impl, block=block), x, w)
    return (y, *vjp(dy))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", ["odd", "empty", "one_group", "beyond", "all_empty"])
def test_blocked_matches_ragged_dot_and_numpy(case, seed):
    rng = np.random.default_rng(seed)
    sizes = _sizes(case, rng)
    E = sizes.shape[0]
    x = rng.normal(size=(M, I)).astype(np.float32)
    w = rng.normal(size=(E, I, O)).astype(np.float32)
    dy = rng.normal(size=(M, O)).astype(np.float32)
    want = _numpy_reference(x, w, sizes, dy)
    total = int(sizes.sum())

    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), jnp.asarray(dy))
    got = {"ragged": _fwd_bwd(*args, impl="ragged", block=None)}
    got |= {f"blocked{b}": _fwd_bwd(*args, impl="blocked", block=b) for b in BLOCKS}
    for name, (y, dx, dw) in got.items():
        assert y.shape == (M, O) and y.dtype == jnp.float32, name
        for label, a, b in (("y", y, want[0]), ("dx", dx, want[1]), ("dw", dw, want[2])):
            np.testing.assert_allclose(a, b, err_msg=f"{name} {label}", **TOL)
        # Beyond sum(group_sizes): exactly zero, in the output and in dx.
        assert not np.any(y[total:]) and not np.any(dx[total:]), name
        if name != "ragged":
            for a, b in zip((y, dx, dw), got["ragged"], strict=True):
                np.testing.assert_allclose(a, b, err_msg=f"{name} vs ragged_dot", **TOL)
    # Empty groups get exactly zero weight gradient.
    for e in np.flatnonzero(sizes == 0):
        assert not np.any(got["blocked3"][2][e])


def test_auto_picks_by_backend(monkeypatch):
    calls = []
    real = jax.lax.ragged_dot
    monkeypatch.setattr(jax.lax, "ragged_dot", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, sizes = jnp.ones((5, 3)), jnp.ones((2, 3, 4)), jnp.array([2, 3], jnp.int32)
    want = {"cpu": 0, "gpu": 1, "tpu": 1}  # ragged_dot calls: "blocked" on CPU, "ragged" on GPU/TPU
    for backend, n in want.items():
        calls.clear()
        monkeypatch.setattr(grouped.jax, "default_backend", lambda backend=backend: backend)
        np.testing.assert_array_equal(grouped_matmul(x, w, sizes), 3.0)
        assert len(calls) == n, backend


def test_default_block():
    assert default_block(16384, 16) == 256  # mean 1024, clamped
    assert default_block(2048, 16) == 128
    assert default_block(3000, 16) == 128  # mean 187.5: the power of two below
    assert default_block(66, 12) == 8  # mean 5.5, clamped
    assert default_block(0, 4) == 8


def test_errors():
    x, w, sizes = jnp.ones((5, 3)), jnp.ones((2, 3, 4)), jnp.array([2, 3], jnp.int32)
    with pytest.raises(ValueError, match="impl='fast' is not one of"):
        grouped_matmul(x, w, sizes, impl="fast")
    with pytest.raises(ValueError, match="do not match"):
        grouped_matmul(x, jnp.ones((2, 4, 4)), sizes)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \[E\]=\(2,\)"):
        grouped_matmul(x, w, jnp.array([5], jnp.int32))
    with pytest.raises(ValueError, match="block must be a positive"):
        grouped_matmul(x, w, sizes, impl="blocked", block=0)
