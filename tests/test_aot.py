"""``jaxmoe compile``: the real train step compiled for a TPU topology on this CPU host.

libtpu runs in subprocesses only (``tests/aot_probe.py`` and the CLI), so this process's backend
and devices stay the 8 fake CPU devices. One probe compiles the tiny config's train step for
``v5p:2x2x2`` and for the same mesh on CPU, its forward with ``dispatch=ragged`` for the slice,
and the engine's decode step for the slice and on CPU.
"""

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxmoe.topology import CHIPS, TopologyError, chip_kind

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = "configs/tiny.py:train"
TOPOLOGY = "v5p:2x2x2"


def _run(*argv, timeout=900):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def probe():
    r = _run(str(ROOT / "tests" / "aot_probe.py"), TINY, TOPOLOGY)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tpu_compile_has_the_cpu_compiles_shapes_and_shardings(probe):
    tpu, cpu = probe["tpu"], probe["cpu"]
    assert len(tpu["inputs"]) > 20 and len(tpu["outputs"]) > len(tpu["inputs"]) - 2
    assert tpu["inputs"] == cpu["inputs"]  # [shape, dtype, spec, shard shape] of every state leaf and the batch
    assert tpu["outputs"] == cpu["outputs"]


def test_report_is_xlas_per_device_memory(probe):
    r, tpu = probe["report"], probe["tpu"]
    assert r["topology"] == TOPOLOGY and r["chips"] == 8 and r["devices"] == 8
    assert r["mesh"] == {"data": 2, "fsdp": 1, "expert": 2, "context": 2, "tensor": 1}
    assert (r["step"], r["stage"], r["dispatch"]) == ("train", "main", "dropless")
    # The arguments are this device's shards of the state and the batch, nothing more: exactly so on
    # CPU; on TPU each shard is padded to the chip's tiled layout (a 64-wide minor dimension takes
    # 128 lanes), so XLA:TPU counts more, but less than twice as much and far less than whole arrays.
    shard_bytes = sum(math.prod(shard) * np.dtype(dtype).itemsize for _, dtype, _, shard in tpu["inputs"])
    whole_bytes = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype, _, _ in tpu["inputs"])
    cpu = probe["cpu"]["memory"]
    assert cpu["argument_bytes"] == shard_bytes < whole_bytes
    assert shard_bytes <= r["argument_bytes"] < 2 * shard_bytes
    assert r == {**r, **tpu["memory"]}
    # The state is donated: its new value is written in place (the outputs add the metrics).
    batch_bytes = 2 * 16 * 64 * 4 // 8  # inputs and targets [16, 64] int32 over 8 devices
    assert cpu["alias_bytes"] == shard_bytes - batch_bytes
    assert 0 < r["argument_bytes"] - r["alias_bytes"] <= 64 * batch_bytes  # the batch, padded
    assert r["temp_bytes"] > 0 and r["generated_code_bytes"] > 0
    total = r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"] + r["generated_code_bytes"]
    assert r["total_bytes"] == total
    assert r["hbm_bytes"] == CHIPS["v5p"].hbm_bytes and r["fits"] is True
    # XLA counts every matmul the step runs (with the backward's and the optimizer's); the analytic
    # model FLOPs count the activated matmuls only, so XLA's figure is larger but of the same order.
    assert r["model_flops_per_token"] < r["flops_per_token"] < 4 * r["model_flops_per_token"]
    assert r["flops_per_step"] == pytest.approx(r["flops_per_token"] * 16 * 64)
    assert r["lower_s"] > 0 and r["compile_s"] > 0


def test_ragged_dispatch_compiles_for_the_slices_devices(probe):
    # On CPU the ragged path refuses (tests/moe/test_expert_parallel.py); for a TPU mesh it must
    # follow the mesh's devices, not the CPU host's default backend.
    r = probe["ragged_forward"]
    assert (r["step"], r["dispatch"]) == ("forward", "ragged") and r["fits"]
    assert "model_flops_per_token" not in r


def test_decode_step_serves_mxfp4_experts_from_the_paged_pools(probe):
    from jaxmoe.config import load_config  # noqa: PLC0415
    from jaxmoe.inference.cache import CacheSpec  # noqa: PLC0415

    r, tpu, cpu = probe["decode"]["report"], probe["decode"]["tpu"], probe["decode"]["cpu"]
    assert (r["step"], r["seqs"], r["context"], r["page_size"]) == ("decode", 4, 256, 16)
    assert r["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1} and r["fits"]
    assert tpu["inputs"] == cpu["inputs"] and tpu["outputs"] == cpu["outputs"]
    # The experts are MXFP4 blocks and scales (uint8), sharded; every other weight keeps its dtype.
    uint8 = [leaf for leaf in tpu["inputs"] if leaf[1] == "uint8"]
    assert uint8 and all(leaf[3] != leaf[0] for leaf in uint8)
    # The pools: one page table of 256 / 16 pages per sequence (and the null page), whole on every device.
    spec = CacheSpec.for_model(load_config(ROOT / TINY).model, num_pages=4 * 16 + 1, num_slots=4)
    assert r["cache_bytes"] == spec.total_bytes
    shapes = [
        *[[spec.num_pages, spec.page_size, spec.latent_width]] * len(spec.latent_layers),
        *[[spec.num_pages, spec.page_size, spec.index_width]] * len(spec.index_layers),
        *[[spec.num_slots, *spec.conv_shape], [spec.num_slots, *spec.state_shape]] * len(spec.kda_layers),
    ]
    pools = [leaf for leaf in cpu["inputs"] if leaf[0] in shapes]
    assert sorted(leaf[0] for leaf in pools) == sorted(shapes)
    assert all(leaf[3] == leaf[0] for leaf in pools)
    assert r["argument_bytes"] >= spec.total_bytes and r["flops_per_token"] > 0


@pytest.mark.parametrize(
    "name, kind",
    [("v5p:8x16x16", "v5p"), ("v6e:16x16", "v6e"), ("v4:4x4x4", "v4"), ("v5e:2x2", "v5e")],
)
def test_chip_kind(name, kind):
    assert chip_kind(name) == kind


@pytest.mark.parametrize("name", ["v9:2x2", "v5p-128", "v5p:", "v5p:4x4xz", "tpu"])
def test_bad_topology_names_the_allowed_kinds(name):
    with pytest.raises(TopologyError, match=r"--topology .*KIND:AxBxC.*v4.*v5e.*v5p.*v6e"):
        chip_kind(name)


def _cli(*args, prelude=""):
    code = f"import sys\n{prelude}\nfrom jaxmoe.cli import main\nsys.exit(main({list(args)!r}))"
    return _run("-c", code, timeout=300)


def test_cli_mesh_that_does_not_match_the_slice_names_both():
    r = _cli("compile", "--config", TINY, "--topology", "v5p:2x2x1")
    assert r.returncode == 1 and r.stdout == ""
    assert "mesh {'data': 2, 'fsdp': 1, 'expert': 2, 'context': 2, 'tensor': 1} has 8 devices" in r.stderr
    assert "topology v5p:2x2x1 has 4" in r.stderr


def test_cli_without_libtpu_says_how_to_get_it():
    r = _cli("compile", "--config", TINY, "--topology", TOPOLOGY, prelude="sys.modules['libtpu'] = None")
    assert r.returncode == 1 and "needs libtpu" in r.stderr and "[tpu]" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology", "v5p:2x2x2"], "--config"),
        (["--config", TINY], "--topology"),
        (["--config", TINY, "--topology", "v5p:2x2x2", "--step", "backward"], "--step"),
        (["--config", TINY, "--topology", "v5p:2x2x2", "--step", "decode", "--seqs", "0"], "--seqs must be a positive"),
        (["--config", TINY, "--topology", "v5p:2x2x2", "--config.mesh.bogus=2"], "mesh.bogus"),
        (["--config", TINY, "--topology", "v9:2x2"], "--topology 'v9:2x2'"),
    ],
)
def test_cli_bad_arguments_name_the_argument(args, message):
    r = _cli("compile", *args)
    assert r.returncode in (1, 2) and message in r.stderr, r.stderr[-2000:]


def test_out_of_hbm_compile_error_gives_the_bytes_xla_needed():
    from jaxmoe.aot import exhausted_memory  # noqa: PLC0415

    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(943.56G) exceeds available HBM (95.74G)."
    )
    assert exhausted_memory(msg) == {"temp_bytes": int(943.56 * 2**30)}
    assert exhausted_memory("RESOURCE_EXHAUSTED: ... required for arguments (512.00M) exceeds ...") == {
        "argument_bytes": 512 * 2**20
    }
    assert exhausted_memory("INTERNAL: something else (943.56G)") is None
