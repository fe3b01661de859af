"""The RL job on the shared tiny run: engine vs trainer log-probabilities (one device and the
8-device mesh), a short GRPO run, kill and resume, 2 processes x 4 devices against 1 x 8, and
config errors."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_run import OVERRIDES, ROOT, coordinator_flags, process_env

from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.config import MESH_AXES, ConfigError, MeshConfig
from jaxmoe.rl.config import load_rl_config
from jaxmoe.rl.domains import DOMAINS
from jaxmoe.rl.loop import _engine, _restore_params, init_root, step_seeds, train_rl
from jaxmoe.rl.rollout import host_batch, rollout
from jaxmoe.rl.step import RLTrainer
from jaxmoe.sharding import make_mesh
from jaxmoe.train.step import Trainer

MODEL_KEYS = [(k, v) for k, v in OVERRIDES if k.startswith("model.")]
SMALL = [
    ("rl.steps", "2"),
    ("rl.prompts_per_step", "3"),
    ("rl.group_size", "4"),
    ("rl.max_tokens", "24"),
    ("rl.eval_prompts", "1"),
    ("rl.eval_samples", "2"),
    ("rl.eval_every", "0"),
    ("rl.checkpoint_every", "1"),
    ("rl.sft.steps", "2"),
]
TIMING = ("rollout_s", "train_s", "rollout_share", "rollout_tokens_per_s", "train_tokens_per_s")


def _configs(extra=()):
    return load_rl_config("configs/tiny.py:rl", [*MODEL_KEYS, *SMALL, *extra])


@pytest.mark.parametrize("mesh_shape", ["one_device", "data2_expert2_context2"])
def test_engine_logprobs_equal_the_trainers(run, mesh_shape):
    cfg, rl = _configs()
    if mesh_shape == "one_device":
        cfg = dataclasses.replace(cfg, mesh=MeshConfig())
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1, 1), MESH_AXES)
    else:
        mesh = make_mesh(cfg.mesh)
    root, tok_dir = init_root(run.workdir)
    tokenizer = Tokenizer.load(tok_dir)
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, mesh)
        rt = RLTrainer(trainer, rl)
        params, bias = _restore_params(root, trainer, cfg)
        engine = _engine(cfg, rl, nnx.merge(trainer.graphdef, params, bias), tokenizer, mesh)
        prompts = [DOMAINS[d].prompts("train", 1, 0)[0] for d in ("code", "tool_args", "budget")]
        outs = rollout(
            engine, tokenizer, prompts, samples=4, seeds=step_seeds(rl, 0, 12),
            budgets={"low": 4, "high": 8, "max": 16}, max_tokens=24, temperature=1.0, top_p=1.0,
        )  # fmt: skip
        host = host_batch(outs, cfg.model.vocab_size)
        s = rt.batch_shardings
        logp, _ = rt.logprobs(params, bias, rt.put(host.inputs, s.inputs), rt.put(host.targets, s.targets),
                              rt.put(host.allowed, s.allowed))  # fmt: skip
    logp = np.asarray(logp)
    on = host.mask > 0
    assert on.sum() == sum(len(r.output_ids) for r in outs) > 20
    # Some tokens were sampled under a constraint that removed part of the vocabulary.
    assert (~host.allowed[on]).any()
    np.testing.assert_allclose(logp[on], host.engine_logp[on], atol=1e-5, rtol=0)


def _records(workdir):
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def _strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.fixture(scope="module")
def whole(run, tmp_path_factory):
    """The short GRPO run on the 8-device mesh, one process: ``(summary, workdir)``."""
    workdir = tmp_path_factory.mktemp("rl") / "whole"
    return train_rl(*_configs(), workdir, run.workdir, progress=False, stdout=False), workdir


def test_rl_run_resumes_bit_for_bit(run, whole, tmp_path):
    cfg, rl = _configs()
    summary, workdir = whole
    assert summary["step"] == 2 and set(summary["heldout_reward"]) == {"code", "tool_args", "budget"}
    records = _records(workdir)
    cold = [r for r in records if "sft_steps" in r]
    assert len(cold) == 1 and cold[0]["sft_steps"] == 2 and cold[0]["sft_loss_last"] < cold[0]["sft_loss_first"]
    assert set(summary["heldout_reward_sft"]) == {"code", "tool_args", "budget"}
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["logprob_diff_max"] < 1e-5 and r["is_masked_fraction"] == 0.0
        assert set(r["reward"]) == {"code", "tool_args", "budget"} and r["tokens"] > 0
    # The update moved the weights unless every group was all-equal (zero advantages).
    assert any(r["grad_norm"] > 0 for r in steps) or all(r["zero_variance_groups"] == 1.0 for r in steps)

    part = tmp_path / "killed"
    train_rl(cfg, rl, part, run.workdir, stop_after=1, progress=False, stdout=False)
    assert [r["step"] for r in _records(part) if "loss" in r] == [1]
    train_rl(cfg, rl, part, run.workdir, progress=False, stdout=False)
    assert _strip(_records(part)) == _strip(records)


def test_two_processes_equal_one(run, whole, tmp_path):
    """Process 0 schedules the engine (process 1 follows its steps), broadcasts the batch; both update."""
    workdir = tmp_path / "two"
    env = process_env(4)
    argv = [sys.executable, "-m", "jaxmoe", "rl", "--config", "configs/tiny.py:rl", "--workdir", str(workdir)]
    argv += ["--init", str(run.workdir), "--no-progress", *coordinator_flags(2)]
    argv += [f"--config.{k}={v}" for k, v in (*MODEL_KEYS, *SMALL)]
    procs = [
        subprocess.Popen([*argv, "--process_id", str(i)], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    # Process 0 writes the metrics and prints them (and the summary); process 1 prints nothing.
    assert [line for line in outs[1][0].splitlines() if line.startswith("{")] == []
    assert json.loads(outs[0][0].splitlines()[-1])["step"] == 2
    two, one = _records(workdir), _records(whole[1])
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 0, 1, 2]  # the cold start's record at 0
    # Both processes saved (Orbax, multi-process) every step's checkpoint.
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
    # The rollouts (sampled on process 0 of either run) are the same tokens: their stats are equal.
    host = {
        "step",
        "learning_rate",
        "rollout_tokens",
        "train_tokens",
        "heldout_reward",
        "heldout_reward_sft",
        "sft_steps",
    }
    for a, b in zip(_strip(two), _strip(one), strict=True):
        assert set(a) == set(b)
        for key, value in b.items():
            if key in host or key.startswith(("reward", "completion_", "reasoning_", "zero_", "truncated_")):
                assert a[key] == value, key
            elif key.startswith("logprob_diff"):  # both below 1e-5 (engine vs trainer, same weights)
                assert a[key] < 1e-5 and value < 1e-5, key
            else:
                # Cross-process all-reduces (gloo) sum in another order than in-process ones: fp32 rounding.
                np.testing.assert_allclose(a[key], value, rtol=2e-6, atol=1e-8, err_msg=key)


def test_rl_config_errors_name_the_field(run, tmp_path):
    with pytest.raises(ConfigError, match="rl.group_size"):
        _configs([("rl.group_size", "1")])
    with pytest.raises(ConfigError, match="rl.domains"):
        _configs([("rl.domains", "code,chess")])
    with pytest.raises(ConfigError, match="rl.thinking.max"):
        _configs([("rl.thinking.max", "40")])
    with pytest.raises(ConfigError, match="unknown key 'stepz'"):
        _configs([("rl.stepz", "3")])
    cfg, rl = load_rl_config("configs/tiny.py:rl", SMALL)  # the 4-layer model: not what the run holds
    with pytest.raises(ConfigError, match="model.num_layers differs"):
        train_rl(cfg, rl, tmp_path / "other", run.workdir, progress=False, stdout=False)
    with pytest.raises(Exception, match="--init"):
        train_rl(*_configs(), tmp_path / "x", tmp_path / "nothing", progress=False, stdout=False)
