"""The checkpoint digest (``jaxmoe.checkpoint.integrity``): one value for an array's bits wherever
it lies (host blocks, one device, any sharding), computed without gathering it, and changed by
any change of one element or of the order of two.

Part of the independent reference is a plain-Python evaluation of the documented formula on a
few elements (no numpy broadcasting, no JAX).
"""

import json
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.checkpoint import integrity
from jaxmoe.checkpoint.integrity import digests, host_digest
from jaxmoe.checkpoint.io import CHECKSUMS_FILE, load_model, save_model
from jaxmoe.config import MeshConfig, load_config
from jaxmoe.errors import CheckpointError
from jaxmoe.model import create_model
from jaxmoe.sharding import make_mesh

M32 = 0xFFFFFFFF


def _fmix(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _python_digest(a: np.ndarray) -> int:
    """The formula element by element: position hash over the axes, two lanes, sums mod 2**32."""
    bits = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    lane_a = lane_b = 0
    for index in np.ndindex(a.shape):
        pos = 0x243F6A88
        for i in index:
            pos = _fmix((pos * 0x9E3779B1 + i) & M32)
        v = int(bits[index])
        lane_a = (lane_a + _fmix(v ^ pos)) & M32
        lane_b = (lane_b + _fmix((v + _fmix(pos ^ 0x85A308D3)) & M32)) & M32
    return (lane_a << 32) | lane_b


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((8, 12)).astype(np.float32),
        "bf16": rng.standard_normal((4, 8, 6)).astype(ml_dtypes.bfloat16),
        "u8": rng.integers(0, 256, (16, 4), dtype=np.uint8),
        "i32": rng.integers(-(2**31), 2**31 - 1, (8,), dtype=np.int32),
        "bool": rng.random((8, 3)) < 0.5,
        "scalar": np.float32(3.5).reshape(()),
        "empty": np.zeros((0, 4), np.float32),
    }


@pytest.mark.parametrize("name", sorted(_arrays()))
def test_host_and_device_equal_the_formula(name):
    a = _arrays()[name]
    want = _python_digest(a.view(np.uint8) if a.dtype == np.bool_ else a)
    assert host_digest(a) == want
    assert digests([jnp.asarray(a)]) == [want]


def test_host_blocks_do_not_change_it(monkeypatch):
    a = np.random.default_rng(1).standard_normal((37, 5, 3)).astype(np.float32)
    want = host_digest(a)
    for block in (1, 15, 16, 100):
        monkeypatch.setattr(integrity, "_HOST_BLOCK", block)
        assert host_digest(a) == want
    assert host_digest(np.asfortranarray(a)) == want  # the value, not the memory layout
    assert host_digest(a.astype(np.int64).view(np.float64)) != 0  # 8-byte types: split lanes, host only


SPECS = [
    ((8, 1), PartitionSpec("a", None)),
    ((2, 4), PartitionSpec("a", "b")),
    ((4, 2), PartitionSpec(None, ("a", "b"))),
    ((2, 4), PartitionSpec("b", None)),  # replicated over 'a'
]


@pytest.mark.parametrize(("shape", "spec"), SPECS, ids=[str(s) for _, s in SPECS])
def test_every_sharding_gives_the_host_value_without_a_gather(shape, spec):
    mesh = jax.make_mesh(shape, ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    a = np.random.default_rng(2).standard_normal((16, 24)).astype(np.float32)
    x = jax.device_put(a, NamedSharding(mesh, spec))
    assert digests([x]) == [host_digest(a)]
    hlo = integrity._device_digests.lower([x]).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert "all-reduce" in hlo or spec == PartitionSpec(None, None)


def test_any_one_element_or_order_change_is_seen():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 7)).astype(np.float32)
    base = host_digest(a)
    seen = set()
    for i in range(a.size):
        for bit in (0, 13, 31):
            b = a.copy().reshape(-1).view(np.uint32)
            b[i] ^= np.uint32(1 << bit)
            seen.add(host_digest(b.view(np.float32).reshape(a.shape)))
    assert base not in seen and len(seen) == a.size * 3
    swapped = a.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert host_digest(swapped) != base
    assert host_digest(a.T.copy()) != base  # same bits, other shape and order
    assert host_digest(a.view(np.int32)) == base  # bits, not values: the dtype is recorded beside it


def test_a_checkpoint_from_before_the_digest_still_verifies(tmp_path):
    """A CRC-32 checksums.json (the earlier format) loads, and a wrong CRC in it is still caught."""
    cfg = load_config("configs/tiny.py")
    path = save_model(create_model(cfg.model, seed=0), cfg, tmp_path / "ckpt")
    _, model = load_model(path)
    data = json.loads((path / CHECKSUMS_FILE).read_text())
    state = nnx.to_pure_dict(nnx.state(model))
    legacy = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        a = np.asarray(leaf)
        crc = zlib.crc32(a.reshape(-1).view(np.uint8))
        legacy[integrity.path_str(kp)] = {"crc32": crc, "shape": list(a.shape), "dtype": str(a.dtype)}
    assert legacy.keys() == data["arrays"].keys()
    (path / CHECKSUMS_FILE).write_text(json.dumps({**data, "algorithm": "crc32", "arrays": legacy}))
    load_model(path, mesh=make_mesh(MeshConfig(data=2, fsdp=4)))
    name = sorted(legacy)[0]
    legacy[name]["crc32"] ^= 1
    (path / CHECKSUMS_FILE).write_text(json.dumps({**data, "algorithm": "crc32", "arrays": legacy}))
    with pytest.raises(CheckpointError, match=f"array '{name}' is corrupt: crc32"):
        load_model(path)
