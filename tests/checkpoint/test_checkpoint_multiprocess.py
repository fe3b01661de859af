"""Two processes x 4 CPU devices (``jax.distributed``, a local coordinator): training checkpoints
save, restore onto another mesh, refuse a corrupted array, and the MXFP4 export is written, with
every gathering route raising in both processes (tests/checkpoint/multiprocess_checkpoint.py).
The export then loads in this process equal, bit for bit, to the quantized state."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
from flax import nnx
from tiny_run import free_port

from jaxmoe.checkpoint.io import load_model
from jaxmoe.config import from_config_dict, load_config_dict
from jaxmoe.quant import quantize_state
from jaxmoe.sharding import make_mesh
from jaxmoe.train.checkpoints import export_config
from jaxmoe.train.step import Trainer, deep_merge

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
CONFIG = str(ROOT / "configs/tiny.py")
# Two layers, MoE in both (MXFP4-packed in the export).
MODEL = {"model.num_layers": 2, "model.layer_kinds": ["kda", "dsa"], "model.moe.first_k_dense": 0}


def test_save_restore_verify_and_export_without_gathering(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    address = f"127.0.0.1:{free_port()}"
    script = str(HERE / "multiprocess_checkpoint.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, address, str(i), str(tmp_path), CONFIG, json.dumps(MODEL)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    reports = [json.loads([line for line in out.splitlines() if line.startswith("{")][-1]) for out, _ in outs]
    # Each process holds (and wrote) about half of the parameters; together, every byte once.
    total = reports[0]["total_bytes"]
    assert all(0 < r["held_bytes"] < 0.75 * total for r in reports)
    assert sum(r["held_bytes"] for r in reports) == total
    for r in reports:
        (message,) = r["refused"]
        assert f"array {r['corrupted']!r} is corrupt: digest64" in message

    cd = load_config_dict(CONFIG)
    cd.model.update(num_layers=2, layer_kinds=("kda", "dsa"))
    cd.model.moe.first_k_dense = 0
    cd.mesh = dict(data=1, fsdp=4, expert=2, context=1, tensor=1)
    cfg_mesh = from_config_dict(cd)
    mesh = make_mesh(cfg_mesh.mesh)
    with jax.set_mesh(mesh):
        state = Trainer(cfg_mesh, mesh).init_state(seed=0)
    host = jax.tree.map(np.asarray, deep_merge(state.params, state.router_bias))
    out_cfg, note = export_config(cfg_mesh)
    assert reports[0]["note"] == note
    want = quantize_state(host, out_cfg.model)
    export_cfg, model = load_model(tmp_path / "export_mxfp4")
    assert export_cfg.model.mxfp4_weights == ("w_gate", "w_up", "w_down")
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, want))
