"""TensorBoard events of :class:`jaxmoe.train.tensorboard.EventLog`, read back by TensorBoard's own
``EventAccumulator``: the values written, a restart's purge of the steps it reruns, every event on
disk at a sync, files that sort in the order written, and the one-object-per-restart bucket copy."""

import math

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxmoe.train.tensorboard import EventLog, read_events


def _scalars(path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` as TensorBoard shows ``path`` (a directory or one file)."""
    acc = EventAccumulator(str(path))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_read_back(tmp_path):
    log = EventLog(tmp_path)
    log.scalars(1, {"loss": 6.25, "moe/expert_load/0/3": 117.0, "lr": 3e-4, "tiny": -1e-30})
    log.scalars(2, {"loss": 5.5, "heldout_loss": float("nan")})
    log.scalars(3, {})
    log.close()
    got = _scalars(tmp_path)
    assert set(got) == {"loss", "moe/expert_load/0/3", "lr", "tiny", "heldout_loss"}
    assert got["loss"] == [(1, 6.25), (2, 5.5)]
    assert got["moe/expert_load/0/3"] == [(1, 117.0)]
    assert got["lr"] == [(1, np.float32(3e-4))] and got["tiny"] == [(1, np.float32(-1e-30))]
    ((step, nan),) = got["heldout_loss"]
    assert step == 2 and math.isnan(nan)  # non-finite values are written as they are


def test_resume_purges_the_rerun_steps(tmp_path):
    first = EventLog(tmp_path)
    for step in range(1, 6):  # checkpoint at step 2, killed after step 5
        first.scalars(step, {"loss": 10.0 + step})
        if step == 2:
            first.sync()
    first.scalars(4, {"heldout_loss": 4.0})
    first.close()
    before = {tag: sorted(v) for tag, v in _scalars(tmp_path).items()}
    assert before == {"loss": [(s, 10.0 + s) for s in range(1, 6)], "heldout_loss": [(4, 4.0)]}

    resumed = EventLog(tmp_path, resume_step=2)  # from the step-2 checkpoint: steps 3.. run again
    resumed.scalars(3, {"loss": 1.5})
    resumed.close()
    # Steps 3-5 of the killed run are gone, the held-out loss of step 4 too (the rerun has not
    # reached it); steps 1 and 2 stay, and step 3 shows the rerun's value once.
    assert _scalars(tmp_path) == {"loss": [(1, 11.0), (2, 12.0), (3, 1.5)], "heldout_loss": []}
    # The old values are still in the killed run's files: TensorBoard hides them.
    old = [e["step"] for f in first.files for e in read_events(f) if "loss" in e["scalars"]]
    assert old == [1, 2, 3, 4, 5]


def test_sync_puts_every_event_on_disk(tmp_path):
    # tensorboardX's own flush returns before its writer thread has written the queued events.
    log = EventLog(tmp_path, resume_step=7)
    for step in range(8, 108):
        log.scalars(step, {"loss": float(step)})
    log.sync()
    assert _scalars(tmp_path) == {"loss": [(s, float(s)) for s in range(8, 108)]}
    log.scalars(108, {"loss": 0.5})  # a new file continues this restart's, without a purge of its own
    log.close()
    assert _scalars(tmp_path)["loss"][-2:] == [(107, 107.0), (108, 0.5)]
    assert [p.name for p in sorted(tmp_path.iterdir())] == [p.name for p in log.files] and len(log.files) == 2


def test_files_sort_in_the_order_written(tmp_path):
    # Within one second the names differ after the time: the purge step, then the part. Each
    # restart opens after the previous one closed, as a resumed run does (a log opens its first
    # file when made, so making all three up front would date the last before the first's part 2).
    logs = []
    for s in (0, 3, 12):
        logs.append(log := EventLog(tmp_path, resume_step=s))
        log.scalars(100, {"loss": 1.0})
        log.sync()
        log.scalars(101, {"loss": 1.0})
        log.close()
    written = [p.name for log in logs for p in log.files]
    assert len(set(written)) == 6 and sorted(written) == written


def test_upload_is_one_file_per_restart(tmp_path):
    remote = tmp_path / "remote"
    log = EventLog(tmp_path / "staging", upload_to=remote)
    log.scalars(1, {"loss": 3.0})
    log.sync()
    assert [p.name for p in remote.iterdir()] == [log.files[0].name]
    assert _scalars(remote) == {"loss": [(1, 3.0)]}
    log.scalars(2, {"loss": 2.0})
    log.close()
    # The concatenation of the restart's files: one event file, every step in it.
    assert [p.name for p in remote.iterdir()] == [log.files[0].name] and len(log.files) == 2
    assert _scalars(remote) == {"loss": [(1, 3.0), (2, 2.0)]}
