"""Workdirs in a bucket (``gs://``), as the TPU launchers use them, against an in-memory GCS.

``gs://B/P`` must reach the code intact (``pathlib`` would make it the local directory
``./gs:/B/P``: every host writing its own, lost with the VM). Metrics and TensorBoard events,
which a bucket cannot append to, are staged locally and copied up; the MXFP4 export is written
locally and uploaded with its config last; ``generate`` reads a bucket's export. Orbax checkpoints
talk to GCS through tensorstore's own driver, which this fake does not reach.
"""

import json

import fsspec
import jax
import numpy as np
import pytest
from flax import nnx
from fsspec.implementations.memory import MemoryFileSystem

from jaxmoe import cli
from jaxmoe.checkpoint.io import CONFIG_FILE
from jaxmoe.paths import is_uri, resolve
from jaxmoe.train.checkpoints import TOKENIZER_FILE, export_done, restore_model, write_export
from jaxmoe.train.generate import generate
from jaxmoe.train.metrics import MetricsWriter
from jaxmoe.train.tensorboard import read_events

WRITES: list[str] = []


class FakeGCS(MemoryFileSystem):
    """GCS as etils.epath reaches it (fsspec protocol ``gcs``), in memory, recording each file written."""

    protocol = ("gs", "gcs")

    def __init__(self, *args, finalize_on_close=None, **kwargs):
        super().__init__(*args, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            WRITES.append(self._strip_protocol(path))
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def bucket():
    fsspec.register_implementation("gcs", FakeGCS, clobber=True)
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    WRITES.clear()
    yield "gs://bucket"
    FakeGCS.store.clear()


def test_uris_stay_intact(tmp_path, monkeypatch):
    assert str(resolve("gs://bucket/runs/a")) == "gs://bucket/runs/a" and is_uri("gs://bucket/runs/a")
    monkeypatch.chdir(tmp_path)
    assert resolve("runs/a") == tmp_path / "runs/a" and not is_uri("runs/a")
    args = cli.build_parser().parse_args(["train", "--config", "configs/tiny.py", "--workdir", "gs://bucket/runs/a"])
    assert str(args.workdir) == "gs://bucket/runs/a"
    args = cli.build_parser().parse_args(["generate", "--checkpoint", "gs://bucket/runs/a", "--prompt", "x"])
    assert str(args.checkpoint) == "gs://bucket/runs/a"


def test_metrics_are_copied_up_and_resume(bucket, tmp_path):
    workdir = f"{bucket}/run"
    writer = MetricsWriter(workdir, stdout=False)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 5.0 - step})
        if step == 2:
            writer.sync()  # a checkpoint at step 2
            remote = resolve(workdir) / "metrics.jsonl"
            assert [json.loads(x)["step"] for x in remote.read_text().splitlines()] == [1, 2]
    writer.close()
    # The run dies after step 3's record; a resumed run from the step-2 checkpoint drops it.
    resumed = MetricsWriter(workdir, resume_step=2, stdout=False)
    resumed.write({"step": 3, "loss": 1.5})
    resumed.close()
    lines = (resolve(workdir) / "metrics.jsonl").read_text().splitlines()
    assert [(r["step"], r["loss"]) for r in map(json.loads, lines)] == [(1, 4.0), (2, 3.0), (3, 1.5)]
    per_file = []
    for remote in (resolve(workdir) / "tensorboard").iterdir():  # one event file per (re)start
        local = tmp_path / remote.name
        local.write_bytes(remote.read_bytes())
        per_file.append([(e["step"], e["scalars"]["loss"]) for e in read_events(local) if e.get("scalars")])
    assert sorted(per_file) == [[(1, 4.0), (2, 3.0), (3, 2.0)], [(3, 1.5)]]


def test_export_to_bucket_and_generate_from_it(run, bucket):
    cfg, model = restore_model(run.workdir / "checkpoints")
    state = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    dst = f"{bucket}/run/export_mxfp4"
    assert not export_done(dst)
    note = write_export(state, cfg, dst, run.workdir / TOKENIZER_FILE)
    assert not note.startswith("skipped") and export_done(dst)
    ours = [w for w in WRITES if "export_mxfp4" in w]
    assert len(ours) > 3 and ours[-1].endswith(f"export_mxfp4/{CONFIG_FILE}")  # complete once the config is there
    top = {p.name for p in (run.workdir / "export_mxfp4").iterdir()}
    assert {p.name for p in resolve(dst).iterdir()} == top and TOKENIZER_FILE in top
    # The same weights as the run's own export: the same greedy continuation.
    want = generate(run.workdir / "export_mxfp4", "class ", max_new_tokens=5)
    assert generate(dst, "class ", max_new_tokens=5)["tokens"] == want["tokens"]
