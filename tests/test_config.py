"""Config loading: every shipped config loads; bad configs fail at load naming the field."""

import copy
import pathlib

import pytest

from jaxmoe.config import ConfigError, from_config_dict, load_config, load_config_dict

CONFIGS = sorted(pathlib.Path(__file__).parent.parent.glob("configs/*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.num_layers == len(cfg.model.layer_kinds)


def _tiny():
    return load_config_dict(pathlib.Path(__file__).parent.parent / "configs/tiny.py").to_dict()


def _with(path: str, value):
    d = copy.deepcopy(_tiny())
    node = d
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return d


BAD = {
    "unknown attention kind": (
        _with("model.layer_kinds", ("mla", "kda", "gqa", "kda")),
        "model.layer_kinds[2]",
    ),
    "top-k larger than experts": (_with("model.moe.experts_per_token", 9), "model.moe.experts_per_token"),
    "heads not divisible by tensor axis": (_with("model.mla.num_heads", 3), "model.mla.num_heads"),
    "expert axis does not divide experts": (_with("mesh.expert", 3), "model.moe.num_experts"),
    "layer-kind list of the wrong length": (_with("model.num_layers", 5), "model.layer_kinds"),
    "groups do not divide experts": (_with("model.moe.num_groups", 3), "model.moe.num_groups"),
    "unknown field": (_with("model.mla.num_head", 4), "model.mla.num_head"),
    "wrong type": (_with("model.d_model", "64"), "model.d_model"),
    "vocab not divisible by tensor axis": (_with("model.vocab_size", 511), "model.vocab_size"),
    "negative mesh axis": (_with("mesh.data", 0), "mesh.data"),
    "unknown dispatch": (_with("model.moe.dispatch", "magic"), "model.moe.dispatch"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_names_field(name):
    d, field = BAD[name]
    with pytest.raises(ConfigError) as e:
        from_config_dict(d)
    assert field in str(e.value), str(e.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.py")
