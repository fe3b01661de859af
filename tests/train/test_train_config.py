"""Training config: top-level keys typed as Config.train, validation naming the field,
``--config.KEY=VALUE`` overrides, and the train/generate command-line errors."""

import dataclasses
import pathlib

import pytest

from jaxmoe import cli
from jaxmoe.config import (
    Config,
    ConfigError,
    MeshConfig,
    from_config_dict,
    load_config,
    load_config_dict,
    validate_training,
)
from jaxmoe.train.loop import build_mesh
from jaxmoe.train.overrides import OverrideError, apply_overrides, split_overrides

ROOT = pathlib.Path(__file__).parents[2]
TINY = ROOT / "configs/tiny.py"


def _tiny(*overrides):
    return from_config_dict(apply_overrides(load_config_dict(f"{TINY}:train"), overrides))


def test_training_keys_are_top_level_and_round_trip():
    cfg = load_config(f"{TINY}:train")
    assert cfg.train.steps == 300 and cfg.train.optim.learning_rate == 3e-3
    assert cfg.mesh == MeshConfig(data=2, expert=2, context=2) and cfg.model.moe.dispatch == "dropless"
    # What CheckpointManager stores (dataclasses.asdict, a nested 'train') reads back the same.
    assert from_config_dict(dataclasses.asdict(cfg)) == cfg
    # Configs without training keys get the defaults; the plain tiny mesh is unchanged.
    plain = load_config(TINY)
    assert plain.mesh == MeshConfig(data=2, fsdp=2, tensor=2)
    d = load_config_dict(TINY).to_dict()
    assert from_config_dict({k: d[k] for k in ("model", "mesh", "name")}).train == Config().train


def test_overrides_typed_and_nested():
    cfg = _tiny(
        ("steps", "7"),
        ("optim.learning_rate", "1e-3"),
        ("mesh.context", "1"),
        ("mesh.data", "4"),
        ("remat", "true"),
        ("model.layer_kinds", "('mla', 'kda', 'dsa', 'mla')"),
        ("model.moe.dispatch", "capacity"),
        ("data.cache_dir", "/tmp/x"),
    )
    assert cfg.train.steps == 7 and cfg.train.optim.learning_rate == 1e-3 and cfg.train.remat is True
    assert cfg.mesh == MeshConfig(data=4, expert=2)
    assert cfg.model.layer_kinds == ("mla", "kda", "dsa", "mla")
    assert cfg.model.moe.dispatch == "capacity" and cfg.train.data.cache_dir == "/tmp/x"
    assert _tiny(("model.layer_kinds", "mla,kda,dsa,kda")).model.layer_kinds == ("mla", "kda", "dsa", "kda")


def test_split_overrides_both_spellings():
    overrides, rest = split_overrides(["train", "--config.steps=3", "--workdir", "w", "--config.seed", "5"])
    assert overrides == [("steps", "3"), ("seed", "5")]
    assert rest == ["train", "--workdir", "w"]


BAD_OVERRIDES = {
    "unknown top-level key": (("stepz", "3"), ["stepz", "allowed keys at the top level", "steps", "optim"]),
    "unknown nested key": (("optim.lr", "1"), ["optim.lr", "'lr'", "learning_rate"]),
    "unknown mesh axis": (("mesh.pipeline", "2"), ["'pipeline'", "context"]),
    "int expected": (("steps", "abc"), ["--config.steps", "expected an int", "'abc'"]),
    "float expected": (("optim.learning_rate", "fast"), ["optim.learning_rate", "expected a float"]),
    "bool expected": (("remat", "maybe"), ["--config.remat", "expected a bool"]),
    "section, not value": (("optim", "1"), ["optim is a section", "optim.learning_rate"]),
    "value, not section": (("steps.x", "1"), ["steps is a value"]),
}


@pytest.mark.parametrize("name", sorted(BAD_OVERRIDES))
def test_bad_override_names_key(name):
    override, needles = BAD_OVERRIDES[name]
    with pytest.raises(OverrideError) as e:
        _tiny(override)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


BAD_CONFIGS = {
    "steps": (("steps", "0"), "steps"),
    "negative learning rate": (("optim.learning_rate", "-1"), "optim.learning_rate"),
    "min_lr_ratio": (("optim.min_lr_ratio", "1.5"), "optim.min_lr_ratio"),
    "b2": (("optim.b2", "1.0"), "optim.b2"),
    "heldout fraction": (("data.heldout_fraction", "0"), "data.heldout_fraction"),
    "negative bias rate": (("moe_balance.bias_rate", "-0.1"), "moe_balance.bias_rate"),
    "eval_every": (("eval_every", "-1"), "eval_every"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_training_field_named(name):
    override, field = BAD_CONFIGS[name]
    with pytest.raises(ConfigError) as e:
        _tiny(override)
    assert str(e.value).startswith(field), str(e.value)


def test_unknown_top_level_key_in_file_and_duplicates():
    d = load_config_dict(f"{TINY}:train").to_dict()
    with pytest.raises(ConfigError, match="unknown config field stepz; allowed top-level fields"):
        from_config_dict({**d, "stepz": 3})
    with pytest.raises(ConfigError, match="steps is given both at the top level and in train"):
        from_config_dict({**d, "train": {"steps": 3}})


MESH_DEPENDENT = {
    "batch not divisible by data x fsdp x expert": (
        (("batch_size", "6"),),
        ["batch_size", "mesh.data x mesh.fsdp x mesh.expert = 4"],
    ),
    "seq_len not divisible by 2 x context": (
        (("seq_len", "34"),),
        ["seq_len", "34 is not divisible by 4 = 2 x mesh.context"],
    ),
    "kda shard shorter than its conv": (
        (
            ("model.layer_kinds", "kda,kda,kda,kda"),
            ("mesh.context", "8"),
            ("mesh.data", "1"),
            ("mesh.expert", "1"),
            ("seq_len", "16"),
        ),
        ["seq_len", "model.kda.conv_kernel"],
    ),
    "vocab below the tokenizer's": ((("model.vocab_size", "266"),), ["model.vocab_size", "267", "11 special tokens"]),
    "seq_len over max_context": ((("seq_len", "8192"),), ["seq_len", "model.max_context=4096"]),
    "mxfp4 weights during training": (
        (("model.mxfp4_weights", "w_gate"), ("mesh.data", "4"), ("mesh.context", "1")),
        ["model.mxfp4_weights", "export_mxfp4"],
    ),
    "dsa warm-up without dsa layers": (
        (("model.layer_kinds", "mla,kda,mla,kda"),),
        ["dsa.warmup_steps", "no dsa layer"],
    ),
}


@pytest.mark.parametrize("name", sorted(MESH_DEPENDENT))
def test_training_checks_name_field(name):
    overrides, needles = MESH_DEPENDENT[name]
    cfg = _tiny(*overrides)
    with pytest.raises(ConfigError) as e:
        validate_training(cfg)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_mesh_device_mismatch_names_mesh_fields():
    cfg = _tiny(("mesh.data", "4"))  # 16 devices; the tests have 8
    with pytest.raises(ConfigError) as e:
        build_mesh(cfg)
    assert "mesh.data=4" in str(e.value) and "needs 16 devices, but 8 are available" in str(e.value)


# --------------------------------------------------------------------------------------------
# Command line


def _cli(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse errors
        code = e.code
    return code, capsys.readouterr().err


def test_cli_bad_override_exits_2(capsys, tmp_path):
    code, err = _cli(capsys, "train", "--config", str(TINY), "--workdir", str(tmp_path), "--config.stepz=3")
    assert code == 2 and "stepz" in err and "allowed keys at the top level" in err
    code, err = _cli(capsys, "train", "--config", str(TINY), "--workdir", str(tmp_path), "--config.steps=x")
    assert code == 2 and "--config.steps: expected an int, got 'x'" in err
    code, err = _cli(capsys, "train", "--config", str(TINY), "--workdir", str(tmp_path), "--config.steps")
    assert code == 2 and "has no value" in err
    code, err = _cli(capsys, "info", "--config", str(TINY), "--config.steps=3")
    assert code == 2 and "belong to train" in err
    assert not any(tmp_path.iterdir())


def test_cli_invalid_config_exits_1(capsys, tmp_path):
    code, err = _cli(capsys, "train", "--config", f"{TINY}:train", "--workdir", str(tmp_path), "--config.batch_size=6")
    assert code == 1 and "batch_size: 6 is not divisible" in err
    code, err = _cli(capsys, "train", "--config", str(TINY), "--workdir", str(tmp_path), "--config.steps=0")
    assert code == 1 and "steps: must be a positive integer" in err


def test_cli_multihost_flags(capsys, tmp_path):
    code, err = _cli(
        capsys, "train", "--config", str(TINY), "--workdir", str(tmp_path), "--coordinator_address", "127.0.0.1:1"
    )
    assert code == 2 and "--num_processes, --process_id missing" in err
    code, err = _cli(
        capsys,
        "train",
        "--config",
        str(TINY),
        "--workdir",
        str(tmp_path),
        "--coordinator_address",
        "127.0.0.1:1",
        "--num_processes",
        "2",
        "--process_id",
        "2",
    )
    assert code == 2 and "--process_id must be in [0, --num_processes=2)" in err
    code, err = _cli(capsys, "train", "--config", str(TINY), "--workdir", str(tmp_path), "--heartbeat_timeout", "0")
    assert code == 2 and "--heartbeat_timeout must be a positive number of seconds, got 0" in err


def test_cli_generate_errors(capsys, tmp_path):
    code, err = _cli(capsys, "generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x")
    assert code == 1 and "is not a directory" in err
    code, err = _cli(capsys, "generate", "--checkpoint", str(tmp_path), "--prompt", "x")
    assert code == 1 and "neither a training workdir" in err
    code, err = _cli(capsys, "generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--max-new-tokens", "0")
    assert code == 2 and "--max-new-tokens must be >= 1" in err
