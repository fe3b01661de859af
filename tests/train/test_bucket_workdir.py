"""Workdirs in a bucket (``gs://``), as the TPU launchers use them, against an in-memory GCS.

``gs://B/P`` must reach the code intact (``pathlib`` would make it the local directory
``./gs:/B/P``: every host writing its own, lost with the VM). Metrics and TensorBoard events,
which a bucket cannot append to, are staged locally and copied up; the MXFP4 export is written
locally and uploaded with its config last; ``generate`` reads a bucket's export where it lies.
Orbax reads a checkpoint's small files through ``etils.epath`` (the fsspec fake) and its arrays
through tensorstore's own GCS driver, which reaches the same in-memory objects through a small
HTTP server speaking the read calls of GCS's JSON API (``TENSORSTORE_GCS_HTTP_URL``).
"""

import http.server
import json
import tempfile
import threading
import urllib.parse

import fsspec
import jax
import numpy as np
import pytest
from flax import nnx
from fsspec.implementations.memory import MemoryFileSystem

from jaxmoe import cli
from jaxmoe.checkpoint.io import CONFIG_FILE
from jaxmoe.inference.generate import generate
from jaxmoe.paths import is_uri, resolve
from jaxmoe.train.checkpoints import TOKENIZER_FILE, export_done, restore_model, write_export
from jaxmoe.train.metrics import MetricsWriter
from jaxmoe.train.tensorboard import read_events

WRITES: list[str] = []
READS: list[str] = []  # objects tensorstore fetched over HTTP


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


class _GCSJsonAPI(http.server.BaseHTTPRequestHandler):
    """``GET /storage/v1/b/BUCKET/o/OBJECT?alt=media`` (with ``Range``), from :class:`FakeGCS`'s store:
    all tensorstore's GCS driver asks for to read a checkpoint."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.split("/")  # ['', 'storage', 'v1', 'b', BUCKET, 'o', OBJECT]
        if len(parts) != 7 or parts[1:4] != ["storage", "v1", "b"] or parts[5] != "o":
            return self._reply(404, b"")
        name = f"{parts[4]}/{urllib.parse.unquote(parts[6])}"
        try:
            body = FakeGCS().cat_file(f"gs://{name}")
        except FileNotFoundError:
            return self._reply(404, b"")
        READS.append(name)
        headers = {"x-goog-generation": "1"}
        if urllib.parse.parse_qs(url.query).get("alt") == ["json"]:
            meta = {"name": parts[6], "bucket": parts[4], "size": str(len(body)), "generation": "1"}
            return self._reply(200, json.dumps(meta).encode(), headers)
        start, _, end = self.headers.get("Range", "bytes=-").removeprefix("bytes=").partition("-")
        if not start and not end:
            return self._reply(200, body, headers)
        first = int(start) if start else max(0, len(body) - int(end))  # "bytes=-N": the last N bytes
        last = min(int(end), len(body) - 1) if start and end else len(body) - 1
        headers["Content-Range"] = f"bytes {first}-{last}/{len(body)}"
        return self._reply(206, body[first : last + 1], headers)

    def _reply(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def gcs_api(bucket, monkeypatch):
    """Points tensorstore's GCS driver at :class:`_GCSJsonAPI` on 127.0.0.1 (a fixed token, no credentials)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GCSJsonAPI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake-token")
    READS.clear()
    yield bucket
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_uris_stay_intact(tmp_path, monkeypatch):
    assert str(resolve("gs://bucket/runs/a")) == "gs://bucket/runs/a" and is_uri("gs://bucket/runs/a")
    monkeypatch.chdir(tmp_path)
    assert resolve("runs/a") == tmp_path / "runs/a" and not is_uri("runs/a")
    args = cli.build_parser().parse_args(["train", "--config", "configs/tiny.py", "--workdir", "gs://bucket/runs/a"])
    assert str(args.workdir) == "gs://bucket/runs/a"
    args = cli.build_parser().parse_args(["generate", "--checkpoint", "gs://bucket/runs/a", "--prompt", "x"])
    assert str(args.checkpoint) == "gs://bucket/runs/a"
    args = cli.build_parser().parse_args(["logits", "--checkpoint", "gs://b/e", "--tokens", "t.npy", "--out", "o.npy"])
    assert str(args.checkpoint) == "gs://b/e"


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


def _no_local_copy(*args, **kwargs):
    raise AssertionError("a local directory was made to read a bucket's checkpoint")


def test_export_to_bucket_and_generate_from_it(run, gcs_api, monkeypatch):
    bucket = gcs_api  # gs://bucket, readable by tensorstore too
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
    # The same weights as the run's own export: the same greedy continuation, read where the export
    # lies: nothing is copied to local disk (no temporary directory), tensorstore fetches the arrays.
    want = generate(run.workdir / "export_mxfp4", "class ", max_new_tokens=5)
    monkeypatch.setattr(tempfile, "mkdtemp", _no_local_copy)
    assert generate(dst, "class ", max_new_tokens=5)["tokens"] == want["tokens"]
    assert any(r.startswith("bucket/run/export_mxfp4/params/") for r in READS), READS
