"""Test set-up: 8 fake CPU devices, fp32 everywhere, and mesh fixtures over several shapes."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One on-disk compilation cache for the session and every process it starts (servers, CLI runs,
# multi-process checks): a program already compiled (same HLO, same devices) is loaded, not
# compiled again. Fresh per session, removed at its end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmoe-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402
from tiny_run import OVERRIDES, TINY_TRAIN, Run  # noqa: E402

from jaxmoe.config import MeshConfig, from_config_dict, load_config_dict  # noqa: E402
from jaxmoe.sharding import make_mesh  # noqa: E402
from jaxmoe.train.loop import train  # noqa: E402
from jaxmoe.train.overrides import apply_overrides  # noqa: E402

# (data, fsdp, expert, context, tensor): every shape uses all 8 devices with >1 on several axes.
MESH_SHAPES = {
    "data8": MeshConfig(data=8),
    "data2_fsdp2_tensor2": MeshConfig(data=2, fsdp=2, tensor=2),
    "fsdp4_tensor2": MeshConfig(fsdp=4, tensor=2),
    "data2_expert2_tensor2": MeshConfig(data=2, expert=2, tensor=2),
}


@pytest.fixture(params=sorted(MESH_SHAPES), ids=sorted(MESH_SHAPES))
def mesh(request):
    m = make_mesh(MESH_SHAPES[request.param])
    with jax.set_mesh(m):
        yield m


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    try:
        import torch

        torch.manual_seed(0)
        torch.set_num_threads(2)
    except ImportError:
        pass


# The shared tiny training run (tests/tiny_run.py): the training, generation and serving tests read it.


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def flags(data_cache):
    """The test config's overrides as ``--config.KEY=VALUE`` flags."""
    return [f"--config.{k}={v}" for k, v in (*OVERRIDES, ("data.cache_dir", str(data_cache)))]


@pytest.fixture(scope="session")
def cfg(data_cache):
    cd = apply_overrides(load_config_dict(TINY_TRAIN), (*OVERRIDES, ("data.cache_dir", str(data_cache))))
    return from_config_dict(cd)


@pytest.fixture(scope="session")
def run(cfg, tmp_path_factory):
    """The uninterrupted 6-step run of the test config."""
    workdir = tmp_path_factory.mktemp("run")
    summary = train(cfg, workdir, progress=False, stdout=False)
    return Run(workdir, summary)


# The slowest files first (measured: each takes 1.5-4 minutes): launch/test.sh's two xdist workers
# take whole files in collection order, and a long file collected last would run alone at the end.
SLOW_FILES = (
    "launch/test_local.py",
    "test_aot.py",
    "train/test_layer_scan.py",
    "serve/test_server_ops.py",
    "checkpoint/test_checkpoint_multiprocess.py",
    "inference/test_multiprocess.py",
    "train/test_train_multiprocess.py",
    "inference/test_forward.py",
    "inference/test_engine.py",
    "rl/test_rl_loop.py",
)


def pytest_collection_modifyitems(session, config, items):
    here = os.path.dirname(__file__)
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), here), len(rank)))  # stable
