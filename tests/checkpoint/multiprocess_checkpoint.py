"""One of two processes (4 CPU devices each) of tests/checkpoint/test_checkpoint_multiprocess.py.

    python multiprocess_checkpoint.py COORDINATOR PROCESS_ID WORKDIR CONFIG OVERRIDES_JSON

Every route by which a process could gather an array it does not own (``process_allgather`` of
more than a barrier's few bytes, ``integrity.to_host`` of an array spanning processes) raises
here. On the 8-device global mesh the process saves the tiny model's training state (params,
optimizer state, data state) with the training CheckpointManager, restores it onto another mesh
(each process compares its own shards with the state it saved), sees a corrupted checksum
record refused naming the array, and writes the MXFP4 export of the params, each process
quantizing its own shards. It prints one JSON line: the bytes of the shards it holds, and the
arrays it saw refused.
"""

import dataclasses
import json
import pathlib
import sys

import jax
from jax.experimental import multihost_utils

coordinator, process_id, workdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# CI shares two cores with the other test worker: heartbeats can stall past JAX's default 100 s.
jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id, heartbeat_timeout_seconds=900)

import numpy as np  # noqa: E402

from jaxmoe.checkpoint import integrity  # noqa: E402
from jaxmoe.checkpoint.manager import CheckpointManager  # noqa: E402
from jaxmoe.config import MeshConfig, from_config_dict, load_config_dict  # noqa: E402
from jaxmoe.errors import CheckpointError  # noqa: E402
from jaxmoe.sharding import make_mesh  # noqa: E402
from jaxmoe.train.checkpoints import write_sharded_export  # noqa: E402
from jaxmoe.train.step import Trainer, deep_merge  # noqa: E402

SMALL = 1024  # bytes: the barriers (Orbax's, sync_global_devices) agree on a name's hash this way
_allgather = multihost_utils.process_allgather


def _small_only(tree, *args, **kwargs):
    size = sum(np.asarray(x).nbytes if not isinstance(x, jax.Array) else x.nbytes for x in jax.tree.leaves(tree))
    if size > SMALL:
        raise AssertionError(f"{size} bytes were gathered across processes")
    return _allgather(tree, *args, **kwargs)


multihost_utils.process_allgather = _small_only
_to_host = integrity.to_host


def _local_only(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise AssertionError(f"to_host of a {x.nbytes}-byte array that spans processes")
    return _to_host(x)


integrity.to_host = _local_only

cd = load_config_dict(sys.argv[4])
for key, value in json.loads(sys.argv[5]).items():  # dotted keys
    *parents, leaf = key.split(".")
    node = cd
    for p in parents:
        node = node[p]
    node[leaf] = tuple(value) if isinstance(value, list) else value
cd.mesh = dict(data=1, fsdp=4, expert=2, context=1, tensor=1)
cfg = from_config_dict(cd)
mesh = make_mesh(cfg.mesh)
with jax.set_mesh(mesh):
    trainer = Trainer(cfg, mesh)
    state = trainer.init_state(seed=0)
root = f"{workdir}/checkpoints"
with CheckpointManager(root) as mgr:
    mgr.save(1, params=state.params, opt_state=state.opt_state, config=cfg, data_state={"position": 7})
    mgr.wait_until_finished()

# Another mesh: each process checks the shards it now holds against the ones it saved.
other = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
other_cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=2, fsdp=2, expert=2))
with jax.set_mesh(other):
    target = Trainer(other_cfg, other).abstract_state()
with CheckpointManager(root) as mgr:
    restored = mgr.restore(1, params=target.params, opt_state=target.opt_state)


def _local_value(x):
    """This process's part of ``x``: its addressable shards, keyed by their global index."""
    return {str(s.index): np.asarray(s.data) for s in x.addressable_shards}


def _same(a, b):
    """The values ``a`` and ``b`` hold at the positions this process holds of ``b``."""
    want = jax.jit(lambda x: x, out_shardings=b.sharding)(a)  # a reshard (a collective, no gather)
    for k, v in _local_value(b).items():
        np.testing.assert_array_equal(v, _local_value(want)[k])


jax.tree.map(_same, state.params, restored.params)
jax.tree.map(_same, state.opt_state, restored.opt_state)
assert restored.data_state == {"position": 7}

# A checksum record that no longer matches the data: refused, naming the array (both processes).
refused = []
files = [p for p in pathlib.Path(root, "1", "checksums").rglob("*") if p.is_file()]
(file,) = [p for p in files if p.read_text().lstrip().startswith("{")]
records = json.loads(file.read_text())
name = sorted(n for n in records if n.startswith("params/"))[0]
multihost_utils.sync_global_devices("read")
if process_id == 0:
    records[name]["digest64"] ^= 1
    file.write_text(json.dumps(records))
multihost_utils.sync_global_devices("corrupted")
try:
    with CheckpointManager(root) as mgr:
        mgr.restore(1, params=target.params)
except CheckpointError as e:
    refused.append(str(e))

export = f"{workdir}/export_mxfp4"
with jax.set_mesh(mesh):
    note = write_sharded_export(deep_merge(state.params, state.router_bias), cfg, export, None)

held = sum(s.data.nbytes for x in jax.tree.leaves(state.params) for s in x.addressable_shards if s.replica_id == 0)
total = sum(x.nbytes for x in jax.tree.leaves(state.params))
out = {"process": process_id, "held_bytes": held, "total_bytes": total, "corrupted": name, "refused": refused}
print(json.dumps({**out, "note": note}))
