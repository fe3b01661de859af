"""Run directories that may live in a bucket.

A training workdir on a pod must be one every host sees and that outlives the VMs: a bucket
(``gs://BUCKET/PATH``). :func:`resolve` keeps such a URI intact as an ``etils.epath.Path`` (GCS
through ``gcsfs``, the ``gcs`` extra; Orbax checkpoints read and write it natively) and makes a
local path absolute. Everything is read where it lies, a bucket through ``epath`` and Orbax,
never copied to local disk first. Object stores cannot append to a file nor rename a directory,
so what a run appends to (metrics, TensorBoard events) or writes atomically (the MXFP4 export) is
written under a local directory first and copied up with :func:`upload_tree`.
"""

from __future__ import annotations

import os
import pathlib

from etils import epath

Path = pathlib.Path | epath.Path


def is_uri(path: str | os.PathLike) -> bool:
    """``scheme://...`` (a bucket or other remote filesystem) rather than a local path."""
    return "://" in os.fspath(path)


def resolve(path: str | os.PathLike) -> Path:
    """A URI as an ``epath.Path`` (``gs://b/p`` stays ``gs://b/p``), a local path made absolute."""
    if is_uri(path):
        return epath.Path(os.fspath(path))
    return pathlib.Path(path).expanduser().absolute()


def upload_tree(src: pathlib.Path, dst: str | Path, *, last: str | None = None) -> None:
    """Copies the local directory ``src`` (files and subdirectories) to ``dst``, file by file;
    the top-level file ``last`` (if any) after all others, so its presence marks a complete copy."""
    dst = resolve(dst)
    files = sorted(p for p in pathlib.Path(src).rglob("*") if p.is_file())
    for file in sorted(files, key=lambda p: p == pathlib.Path(src) / last if last else False):
        target = dst / file.relative_to(src).as_posix()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(file.read_bytes())
