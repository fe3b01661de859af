"""Shared set-up of the training tests: one small training run that several tests read, its
config (also as ``--config.KEY=VALUE`` flags for subprocess runs) and a data cache.

Runs of the same program in one process compile once (the train step is a module-level function
jitted with static config), so the tests that train the same config again pay no compilation."""

import dataclasses
import json
import pathlib

import pytest

from jaxmoe.config import from_config_dict, load_config_dict
from jaxmoe.train.loop import train
from jaxmoe.train.overrides import apply_overrides

ROOT = pathlib.Path(__file__).parents[2]
TINY_TRAIN = f"{ROOT / 'configs/tiny.py'}:train"

# The tiny model cut to one DSA + MoE layer (DSA's dense warm-up is MLA), trained for 6 steps on
# the config's mesh data 2 x expert 2 x context 2: 2 warm-up steps, then 4 sparse ones (top-8 of 32).
OVERRIDES = (
    ("model.num_layers", "1"),
    ("model.layer_kinds", "('dsa',)"),
    ("model.moe.first_k_dense", "0"),
    ("model.indexer.topk", "8"),
    ("steps", "6"),
    ("batch_size", "8"),
    ("seq_len", "32"),
    ("dsa.warmup_steps", "2"),
    ("log_every", "1"),
    ("eval_every", "3"),
    ("eval_batches", "2"),
    ("checkpoint_every", "3"),
    ("data.max_bytes", "300000"),
    ("data.heldout_fraction", "0.1"),
    ("peak_flops", "1e10"),
)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def flags(data_cache):
    """The test config's overrides as ``--config.KEY=VALUE`` flags."""
    return [f"--config.{k}={v}" for k, v in (*OVERRIDES, ("data.cache_dir", str(data_cache)))]


@pytest.fixture(scope="session")
def cfg(data_cache):
    cd = apply_overrides(load_config_dict(TINY_TRAIN), (*OVERRIDES, ("data.cache_dir", str(data_cache))))
    return from_config_dict(cd)


@dataclasses.dataclass
class Run:
    workdir: pathlib.Path
    summary: dict

    def records(self) -> list[dict]:
        return [json.loads(line) for line in (self.workdir / "metrics.jsonl").read_text().splitlines()]

    def values(self, key: str = "loss") -> dict[int, float]:
        """``{step: record[key]}`` over the records that have ``key``."""
        return {r["step"]: r[key] for r in self.records() if key in r}


@pytest.fixture(scope="session")
def run(cfg, tmp_path_factory):
    """The uninterrupted 6-step run of the test config."""
    workdir = tmp_path_factory.mktemp("run")
    summary = train(cfg, workdir, progress=False, stdout=False)
    return Run(workdir, summary)
