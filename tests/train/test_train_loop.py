"""The training job end to end: metrics, held-out loss, checkpoints and export of a short run;
kill-and-resume equal to the uninterrupted run bit for bit; resume onto another mesh."""

import dataclasses
import json
import math
import pathlib
import shutil

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.checkpoint.io import load_model
from jaxmoe.config import MeshConfig
from jaxmoe.train.loop import train
from jaxmoe.train.metrics import model_flops_per_token
from jaxmoe.train.optim import learning_rate


def _values(workdir, key: str = "loss") -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


REQUIRED = ("step", "loss", "tokens_per_s", "mfu", "lr", "grad_norm", "expert_load", "max_mean_load", "drop_fraction")


def test_metrics_records(run, cfg):
    records = run.records()
    steps = [r["step"] for r in records]
    assert steps == list(range(1, cfg.train.steps + 1))
    for r in records:
        for key in REQUIRED:
            assert key in r, (key, r)
        assert all(math.isfinite(r[k]) for k in ("loss", "lr", "grad_norm"))
        # The timed figures vary with the machine's load: only how they follow from the step time.
        tokens = cfg.train.batch_size * cfg.train.seq_len
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-12)
        flops = model_flops_per_token(cfg, r["stage"])
        assert r["mfu"] == pytest.approx(
            flops * r["tokens_per_s"] / (cfg.train.peak_flops * cfg.mesh.num_devices), rel=1e-12
        )
        # Every token sends experts_per_token assignments; the dropless dispatch drops none.
        assert {k: sum(v) for k, v in r["expert_load"].items()} == {"0": tokens * cfg.model.moe.experts_per_token}
        assert r["drop_fraction"] == 0.0
        loads = np.asarray(r["expert_load"]["0"])
        assert r["max_mean_load"]["0"] == pytest.approx(loads.max() / loads.mean())
    assert [r["stage"] for r in records] == ["warmup"] * 2 + ["main"] * 4
    # Warm-up: the rate of the indexer's optimizer; then warm-up + cosine over the 4 main steps.
    main_lr = learning_rate(cfg.train.optim, 4)
    expected = [cfg.train.dsa.warmup_learning_rate] * 2 + [float(main_lr(i)) for i in range(4)]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-6)
    # Held-out loss every eval_every steps and at the end; compile time when a stage starts.
    assert sorted(run.values("heldout_loss")) == [3, 6]
    assert sorted(run.values("compile_s")) == [1, 3]


def test_losses_fall_and_outputs(run, cfg):
    loss, heldout = run.values("loss"), run.values("heldout_loss")
    # The main stage trains everything: the loss falls from its first step to the last.
    assert loss[6] < loss[3] - 0.01
    assert heldout[6] < heldout[3]
    assert run.summary["step"] == 6 and run.summary["heldout_loss"] == heldout[6]
    assert sorted(p.name for p in (run.workdir / "checkpoints").iterdir()) == ["3", "6"]
    assert (run.workdir / "tokenizer.json").is_file()
    export_cfg, model = load_model(run.workdir / "export_mxfp4")
    assert export_cfg.model.mxfp4_weights == ("w_gate", "w_up", "w_down")
    assert export_cfg.mesh == cfg.mesh  # the experts' dims divide into MXFP4 blocks on the training mesh
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tokenizer folder, in the workdir and export
        assert (run.workdir / "export_mxfp4" / name).read_bytes() == (run.workdir / name).read_bytes()
    assert Tokenizer.load(run.workdir / "export_mxfp4").eos_id == 0


@pytest.fixture(scope="module")
def stopped(cfg, tmp_path_factory):
    """A run killed after step 4: its last checkpoint is step 3, metrics.jsonl has steps 1-4."""
    workdir = tmp_path_factory.mktemp("stopped")
    summary = train(cfg, workdir, stop_after=4, progress=False, stdout=False)
    assert summary["step"] == 4
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3"]
    return workdir


def test_kill_and_resume_is_bitwise(run, cfg, stopped, tmp_path, capsys):
    workdir = tmp_path / "resumed"
    shutil.copytree(stopped, workdir)
    capsys.readouterr()
    summary = train(cfg, workdir, progress=False, stdout=True)
    assert summary["step"] == 6
    # Steps 4-6 ran again (from the step-3 checkpoint), one JSON line each on stdout.
    assert [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()] == [4, 5, 6]
    assert sorted(_values(workdir, "step")) == list(range(1, 7))  # step 4 is not in metrics.jsonl twice
    for key in ("loss", "total_loss", "grad_norm", "indexer_kl", "heldout_loss", "expert_load"):
        assert _values(workdir, key) == run.values(key), key
    # TensorBoard too shows each step once: the restart purged the killed run's step 4.
    tb = _tensorboard(workdir)
    assert tb["loss"] == {s: np.float32(v) for s, v in run.values("loss").items()}
    assert tb["heldout_loss"] == {s: np.float32(v) for s, v in run.values("heldout_loss").items()}


def test_resume_onto_another_mesh(run, cfg, stopped, tmp_path):
    workdir = tmp_path / "other_mesh"
    shutil.copytree(stopped, workdir)
    other = dataclasses.replace(cfg, mesh=MeshConfig(data=4, expert=2))
    train(other, workdir, progress=False, stdout=False)
    ref, got = run.values(), _values(workdir)
    assert [got[s] for s in (1, 2, 3)] == [ref[s] for s in (1, 2, 3)]  # from the first run's metrics
    np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [ref[s] for s in (4, 5, 6)], rtol=0, atol=1e-5)
    assert _values(workdir, "heldout_loss")[6] == pytest.approx(run.values("heldout_loss")[6], abs=1e-5)


def test_restart_after_the_end_does_nothing(run, cfg, tmp_path):
    workdir = tmp_path / "done"
    shutil.copytree(run.workdir, workdir)
    before = (workdir / "metrics.jsonl").read_text()
    summary = train(cfg, workdir, progress=False, stdout=False)
    assert summary["step"] == 6
    assert (workdir / "metrics.jsonl").read_text() == before


def test_other_model_in_workdir_is_refused(run, cfg, tmp_path):
    from jaxmoe.config import ConfigError  # noqa: PLC0415

    workdir = tmp_path / "other_model"
    shutil.copytree(run.workdir, workdir)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32))
    with pytest.raises(ConfigError, match="model.d_model"):
        train(other, workdir, progress=False, stdout=False)


def _tensorboard(workdir) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` as TensorBoard shows ``workdir/tensorboard`` (each step at most once)."""
    acc = EventAccumulator(str(workdir / "tensorboard"))
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        steps = [(e.step, e.value) for e in acc.Scalars(tag)]
        out[tag] = dict(steps)
        assert len(out[tag]) == len(steps), (tag, steps)
    return out


def test_tensorboard_events_match_metrics(run):
    tb = _tensorboard(run.workdir)
    records = run.records()
    assert sorted(tb["loss"]) == [r["step"] for r in records]
    for r in records:
        assert tb["loss"][r["step"]] == np.float32(r["loss"])
        assert tb["expert_load/0/3"][r["step"]] == r["expert_load"]["0"][3]
        if "heldout_loss" in r:
            assert tb["heldout_loss"][r["step"]] == np.float32(r["heldout_loss"])


def test_metrics_writer_keeps_steps_up_to_the_checkpoint(tmp_path):
    from jaxmoe.train.metrics import MetricsWriter  # noqa: PLC0415

    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')  # killed mid-line
    writer = MetricsWriter(tmp_path, resume_step=3, stdout=False)
    writer.write({"step": 4, "loss": 0.5})
    writer.close()
    assert _values(tmp_path) == {1: 1.0, 2: 0.5, 3: 1.0 / 3, 4: 0.5}


def test_export_config_falls_back_to_one_device():
    from jaxmoe.config import load_config  # noqa: PLC0415
    from jaxmoe.train.checkpoints import export_config  # noqa: PLC0415

    tiny = load_config(pathlib.Path(__file__).parents[2] / "configs/tiny.py")  # tensor 2: w_down's 32 cannot split
    out, note = export_config(tiny)
    assert out.mesh == MeshConfig() and out.model.mxfp4_weights == ("w_gate", "w_up", "w_down")
    assert note.startswith("one-device mesh") and "model.moe.expert_ffw_dim" in note
    odd = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, d_model=48), mesh=MeshConfig())
    out, note = export_config(odd)
    assert out is None and note.startswith("skipped") and "model.d_model" in note
