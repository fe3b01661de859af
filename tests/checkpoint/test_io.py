"""Model checkpoints: save on the host, restore onto a mesh by the sharding rules."""

import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.checkpoint.io import load_model, save_model
from jaxmoe.config import load_config
from jaxmoe.model import create_model
from jaxmoe.sharding import logical_to_spec

ROOT = pathlib.Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = load_config(ROOT / "configs/tiny.py")
    model = create_model(cfg.model, seed=3)
    path = save_model(model, cfg, tmp_path_factory.mktemp("io") / "ckpt")
    return cfg, model, path


def test_restore_onto_mesh(saved, mesh):
    cfg, model, path = saved
    cfg2, restored = load_model(path, mesh=mesh)
    assert cfg2 == cfg
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        nnx.to_pure_dict(nnx.state(model)),
        nnx.to_pure_dict(nnx.state(restored)),
    )
    assert restored.layers[1].ffn.w_up[...].sharding.spec == logical_to_spec(("experts", "embed", "expert_ffw"))


def test_refuses_to_overwrite(saved):
    cfg, model, path = saved
    with pytest.raises(FileExistsError, match="already exists"):
        save_model(model, cfg, path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(tmp_path)
