"""TensorBoard scalars of a training run, written by ``tensorboardX``.

A restart from the checkpoint of step ``s`` runs the steps after ``s`` again, so its writer has
``purge_step = s + 1``: TensorBoard then drops the events of steps ``>= s + 1`` that earlier files
hold (a killed run's records past its last checkpoint) and shows the rerun's.

tensorboardX writes from a background thread, and its ``flush`` does not wait for that thread's
queue: only ``close`` puts every event on disk. :meth:`EventLog.sync`, called at every checkpoint,
therefore closes the current file and the next event opens another, so a restart's events are a
few files, one per checkpoint interval. For a bucket workdir they are written to a local
directory, and each sync copies their concatenation (a valid event file: event files are
sequences of records) up as one object per restart.

File names are ``events.out.tfevents.<time>.<host>.<purge step>.<part>.<id>``: the random id keeps
two writers from replacing each other's bucket copy, and the zero-padded purge step and part keep
files of the same second in the order they were written (TensorBoard reads a directory's files in
name order, and a restart's purge must come after the files it purges).
"""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import Mapping

from tensorboardX import SummaryWriter
from tensorboardX.proto.summary_pb2 import Summary

from jaxmoe.paths import Path

# How long an event may wait before a live TensorBoard sees it (tensorboardX's default is 120 s).
# Events of steps up to a checkpoint are on disk at its sync; later ones are rerun after a kill.
FLUSH_SECS = 10


class EventLog:
    """The scalars of one (re)start of a run as event files in ``logdir``.

    Args:
        logdir: a local directory (created if missing).
        resume_step: the step the run starts from (0 for a fresh start); TensorBoard drops the
            events of later steps that older files of the same directory hold.
        upload_to: a bucket directory to copy this restart's events to at each :meth:`sync`.
    """

    def __init__(self, logdir: str | os.PathLike, *, resume_step: int = 0, upload_to: Path | None = None):
        self.logdir = pathlib.Path(logdir)
        self._purge_step = resume_step + 1
        self._upload_to = upload_to
        self._id = uuid.uuid4().hex[:8]
        self.files: list[pathlib.Path] = []  # this restart's files, in order
        self._writer: SummaryWriter | None = None
        self._open()  # now, not at the first record: the purge is written even if none follows

    def _open(self) -> SummaryWriter:
        suffix = f".{self._purge_step:09d}.{len(self.files):04d}.{self._id}"
        purge = None if self.files else self._purge_step  # the first file purges; later ones continue it
        self._writer = SummaryWriter(str(self.logdir), purge_step=purge, flush_secs=FLUSH_SECS, filename_suffix=suffix)
        (path,) = self.logdir.glob(f"events.out.tfevents.*{suffix}")
        self.files.append(path)
        return self._writer

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Writes ``{tag: value}`` at ``step`` (non-finite values as they are)."""
        if not values:
            return
        writer = self._writer or self._open()
        # One event for all: add_scalar's event per tag, each through the writer thread's queue,
        # takes ~0.1 s for the 1,500 expert-load tags of a mid-size model.
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        writer.file_writer.add_summary(summary, step)

    def sync(self) -> None:
        """Puts every event so far on disk and, with ``upload_to``, copies this restart's events there."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._upload_to is not None:
            remote = self._upload_to / self.files[0].name
            remote.parent.mkdir(parents=True, exist_ok=True)
            remote.write_bytes(b"".join(p.read_bytes() for p in self.files))

    def close(self) -> None:
        self.sync()


def read_events(path: str | os.PathLike) -> list[dict]:
    """The events of one event file as ``{"step", "wall_time", "scalars": {tag: value}}`` (and
    ``"file_version"`` where set), read by TensorBoard's own loader (the ``tensorboard`` package,
    a test dependency)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader  # noqa: PLC0415

    events = []
    for e in LegacyEventFileLoader(str(path)).Load():
        event = {"step": e.step, "wall_time": e.wall_time, "scalars": {v.tag: v.simple_value for v in e.summary.value}}
        if e.file_version:
            event["file_version"] = e.file_version
        events.append(event)
    return events
