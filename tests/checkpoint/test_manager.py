"""Training checkpoints: mesh-independent bit-exact restore (MXFP4 included), keep-N, a killed save, corruption."""

import dataclasses
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxmoe.checkpoint.manager import CheckpointManager, abstract_target
from jaxmoe.config import MeshConfig, from_config_dict, load_config_dict
from jaxmoe.errors import CheckpointError
from jaxmoe.model import abstract_model
from jaxmoe.quant import quantize_state
from jaxmoe.sharding import make_mesh, state_shardings

ROOT = pathlib.Path(__file__).parent.parent.parent
DATA_STATE = {"epoch": 1, "position": 12345, "shuffle_seed": 7, "shards": ["a", "b"]}


def _cfg():
    """Tiny, with MXFP4 routed experts; dims divisible by 32 x the (2, 4) mesh's fsdp."""
    cd = load_config_dict(ROOT / "configs/tiny.py")
    cd.model.d_model = 128
    cd.model.moe.expert_ffw_dim = 64
    cd.model.mxfp4_weights = ("w_gate", "w_up", "w_down")
    cd.mesh = dict(data=2, fsdp=4, expert=1, context=1, tensor=1)
    return from_config_dict(cd)


def _train_state(cfg, mesh):
    """Random params of the model's shapes (float + packed uint8) and a non-trivial Adam state, sharded on ``mesh``.

    (Random values instead of ``create_model``: the eager init costs ~20 s on 2 CPU cores.)
    """
    float_model = dataclasses.replace(cfg.model, mxfp4_weights=())
    rng = np.random.default_rng(5)
    abstract = nnx.to_pure_dict(nnx.state(abstract_model(float_model)))
    host = jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)
    host = jax.tree.map(np.asarray, quantize_state(host, cfg.model))
    shardings = nnx.to_pure_dict(state_shardings(nnx.state(abstract_model(cfg.model)), mesh))
    params = jax.device_put(host, shardings)
    # What the optimizer sees: nnx.Param leaves (not the packed weights, not the router bias).
    is_param = nnx.to_pure_dict(nnx.state(abstract_model(cfg.model), nnx.Param))
    trainable = jax.tree.map(lambda _, p: p, is_param, _subtree(params, is_param))
    tx = optax.adam(1e-3)
    opt = jax.jit(tx.init)(trainable)
    grads = jax.tree.map(lambda p: 0.1 * p + 0.01, trainable)
    _, opt = jax.jit(tx.update)(grads, opt, trainable)
    return params, opt, tx


def _subtree(tree, like):
    return {k: _subtree(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def _targets(cfg, mesh):
    """Abstract params and optimizer state with the shardings of ``mesh`` (None: one device)."""
    graphdef, abstract = nnx.split(abstract_model(cfg.model))
    if mesh is None:
        dev = SingleDeviceSharding(jax.devices()[0])
        shard = jax.tree.map(lambda _: dev, abstract)
    else:
        shard = state_shardings(abstract, mesh)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract),
        nnx.to_pure_dict(shard),
    )
    float_params = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, abstract), nnx.Param))
    float_shard = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, shard), nnx.Param))
    opt = jax.eval_shape(optax.adam(1e-3).init, float_params)
    replicated = dev if mesh is None else NamedSharding(mesh, PartitionSpec())
    # mu and nu are shaped (and sharded) like the params; the step count is replicated.
    opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), opt)
    opt = (opt[0]._replace(mu=_like(opt[0].mu, float_shard), nu=_like(opt[0].nu, float_shard)), *opt[1:])
    return params, opt


def _like(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _assert_identical(got, want, target):
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree.leaves(want)
    flat_target = jax.tree.leaves(target)
    assert len(flat_got) == len(flat_want) == len(flat_target)
    for (path, g), w, t in zip(flat_got, flat_want, flat_target):
        assert g.dtype == w.dtype, path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(path))
        assert g.sharding.is_equivalent_to(t.sharding, g.ndim), path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = _cfg()
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    with jax.set_mesh(mesh):
        params, opt, _ = _train_state(cfg, mesh)
    root = tmp_path_factory.mktemp("mgr") / "run"
    with CheckpointManager(root, max_to_keep=2) as mgr:
        assert mgr.save(10, params=params, opt_state=opt, data_state=DATA_STATE, config=cfg)
        mgr.wait_until_finished()
    host = jax.tree.map(np.asarray, (params, opt))
    return cfg, root, host


@pytest.mark.parametrize("mesh_shape", [dict(data=8), None], ids=["data8", "one_device"])
def test_restore_on_another_mesh_is_bit_identical(saved, mesh_shape):
    cfg, root, (params, opt) = saved
    mesh = None if mesh_shape is None else make_mesh(MeshConfig(**mesh_shape))
    params_target, opt_target = _targets(cfg, mesh)
    with CheckpointManager(root) as mgr:
        out = mgr.restore(params=params_target, opt_state=opt_target)
    assert out.step == 10 and out.config == cfg and out.data_state == DATA_STATE
    packed = out.params["layers"][1]["ffn"]["w_up"]
    assert packed["blocks"].dtype == np.uint8 and packed["scales"].dtype == np.uint8
    _assert_identical(out.params, params, params_target)
    _assert_identical(out.opt_state, opt, opt_target)


def test_restore_without_optimizer_and_from_arrays(saved):
    cfg, root, (params, _) = saved
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    params_target, _ = _targets(cfg, mesh)
    concrete = jax.tree.map(lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding), params_target)
    with CheckpointManager(root) as mgr:
        out = mgr.restore(10, params=concrete)  # arrays as targets: their shardings are used
    assert out.opt_state is None
    _assert_identical(out.params, params, abstract_target(concrete))


def test_keep_n_and_interval(tmp_path):
    cfg = _cfg()
    tree = {"w": np.arange(7.0, dtype=np.float32)}
    with CheckpointManager(tmp_path / "run", max_to_keep=2, save_interval_steps=2) as mgr:
        saved = [mgr.save(s, params=jax.tree.map(lambda x, s=s: x + s, tree), config=cfg) for s in range(2, 8)]
        mgr.wait_until_finished()
        assert saved == [True, False, True, False, True, False]  # the first save always happens
        assert mgr.all_steps() == [4, 6]
        target = abstract_target(jax.device_put(tree))
        np.testing.assert_array_equal(np.asarray(mgr.restore(params=target).params["w"]), tree["w"] + 6)
        with pytest.raises(CheckpointError, match="has no complete step 2"):
            mgr.restore(2, params=target)


def test_refuses_other_shapes_and_dtypes(saved):
    cfg, root, _ = saved
    params_target, _ = _targets(cfg, None)
    bad = dict(params_target, embed=jax.ShapeDtypeStruct((7, 3), np.float32, sharding=params_target["embed"].sharding))
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointError, match=r"array 'params/embed' is stored as"):
        mgr.restore(params=bad)


def test_flipped_byte_names_array_and_step(saved, tmp_path):
    cfg, root, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    data = max((p for p in (copy / "10" / "params").rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    params_target, _ = _targets(cfg, None)
    with CheckpointManager(copy) as mgr, pytest.raises(CheckpointError) as info:
        mgr.restore(params=params_target)
    msg = str(info.value)
    assert str(copy / "10") in msg and "array 'params/" in msg


KILLED_SAVE = textwrap.dedent(
    """
    import sys, numpy as np
    from jaxmoe.checkpoint.manager import CheckpointManager
    from jaxmoe.config import load_config
    cfg = load_config(sys.argv[2])
    mgr = CheckpointManager(sys.argv[1], max_to_keep=5)
    mgr.save(1, params={"w": np.arange(1000, dtype=np.float32)}, config=cfg)
    mgr.wait_until_finished()
    rng = np.random.default_rng(0)
    big = {f"w{i}": rng.integers(0, 2**32, size=(16 << 20,), dtype=np.uint32).view(np.float32) for i in range(8)}
    mgr.save(2, params=big, config=cfg)  # 512 MB, incompressible: written in the background
    print("WRITING", flush=True)
    mgr.wait_until_finished()
    print("DONE", flush=True)
    """
)


def test_killed_save_leaves_previous_step(tmp_path):
    root = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(root), str(ROOT / "configs/tiny.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        proc.kill()  # SIGKILL while step 2's arrays are being written
    finally:
        proc.wait()
    leftovers = [p.name for p in root.iterdir() if p.name not in ("1",)]
    assert "2" not in leftovers and leftovers, f"expected an unfinished step-2 directory, found {leftovers}"
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1]
        target = {"w": jax.ShapeDtypeStruct((1000,), np.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
        out = mgr.restore(params=target)
        assert out.step == 1
        np.testing.assert_array_equal(np.asarray(out.params["w"]), np.arange(1000, dtype=np.float32))
        mgr.save(2, params={"w": np.ones(3, np.float32)}, config=out.config)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]


def test_config_field_survives(saved):
    cfg, root, _ = saved
    params_target, _ = _targets(cfg, None)
    with CheckpointManager(root) as mgr:
        out = mgr.restore(params=params_target)
    assert dataclasses.asdict(out.config) == dataclasses.asdict(cfg)
