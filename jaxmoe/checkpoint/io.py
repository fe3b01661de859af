"""Model checkpoints: ``DIR/config.json`` (the typed config) and ``DIR/params`` (Orbax).

Restore always targets the abstract model with shardings, so a checkpoint written on one mesh
restores onto another (or onto one device).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxmoe.config import Config, ConfigError, from_config_dict
from jaxmoe.sharding import state_shardings

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_model(model: nnx.Module, cfg: Config, path: str | pathlib.Path) -> pathlib.Path:
    """Writes ``path/config.json`` and ``path/params``; refuses to overwrite an existing checkpoint."""
    path = pathlib.Path(path).absolute()
    if (path / PARAMS_DIR).exists():
        raise FileExistsError(f"checkpoint {str(path)!r} already exists; choose a new destination")
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    state = nnx.to_pure_dict(nnx.state(model))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, state)
        ckptr.wait_until_finished()
    return path


def load_config_from_checkpoint(path: str | pathlib.Path) -> Config:
    path = pathlib.Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ConfigError(f"{str(path)!r} is not a jaxmoe checkpoint: it has no {CONFIG_FILE}")
    return from_config_dict(json.loads(cfg_file.read_text()))


def load_model(path: str | pathlib.Path, mesh: jax.sharding.Mesh | None = None):
    """Restores ``(cfg, model)``; parameters are placed by the sharding rules on ``mesh`` (or one device)."""
    from jaxmoe.model import abstract_model  # noqa: PLC0415 (model imports every module)

    path = pathlib.Path(path).absolute()
    cfg = load_config_from_checkpoint(path)
    abstract = abstract_model(cfg.model)
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is None:
        device = jax.devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), abstract_state)
    else:
        shardings = state_shardings(abstract_state, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract_state),
        nnx.to_pure_dict(shardings),
    )
    if not (path / PARAMS_DIR).exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no {PARAMS_DIR}/ directory")
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path / PARAMS_DIR, target)
    nnx.replace_by_pure_dict(abstract_state, restored)
    return cfg, nnx.merge(graphdef, abstract_state)
