"""What a training workdir holds besides the live run: its checkpoints read back on one device,
and the MXFP4 export of the final params.

The export is a model checkpoint (:mod:`jaxmoe.checkpoint.io`: ``config.json``, ``checksums.json``,
``params/``) with the routed experts packed in MXFP4, plus the tokenizer files (``tokenizer.json``,
``tokenizer_config.json``), so ``jaxmoe generate``
and ``jaxmoe logits`` read it alone. A single process streams it from host arrays; in a
multi-process run every process quantizes the shards it holds and writes them
(:func:`write_sharded_export`), so no process ever holds a whole weight.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxmoe.chat.tokenizer import TOKENIZER_FILE, copy_tokenizer_files, tokenizer_files
from jaxmoe.checkpoint.manager import CheckpointManager
from jaxmoe.config import MXFP4_WEIGHTS, Config, ConfigError, MeshConfig, from_config_dict, validate
from jaxmoe.errors import CheckpointError
from jaxmoe.layer_plan import unstack_layers
from jaxmoe.model import abstract_model, layer_plan
from jaxmoe.paths import Path, is_uri, resolve, upload_tree

CHECKPOINT_DIR = "checkpoints"
EXPORT_DIR = "export_mxfp4"


def stored_config(root: str | pathlib.Path, step: int) -> Config:
    """The typed config saved with ``step`` under the checkpoint root ``root`` (read without the arrays)."""
    options = ocp.CheckpointManagerOptions(create=False)
    try:
        with ocp.CheckpointManager(resolve(root), item_names=("config",), options=options) as mgr:
            values = mgr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except Exception as e:  # noqa: BLE001 (a damaged or missing item: say which)
        raise CheckpointError(f"checkpoint {str(root)!r} step {step}: its config cannot be read: {e}") from e
    return from_config_dict(values)


def restore_model(root: str | pathlib.Path, step: int | None = None) -> tuple[Config, nnx.Module]:
    """The model state (router biases included) of a training checkpoint step (default: the newest), on one device."""
    root = resolve(root)
    if step is None:
        with CheckpointManager(root) as mgr:
            step = mgr.latest_step()
        if step is None:
            raise CheckpointError(f"checkpoint root {str(root)!r} holds no complete step")
    cfg = stored_config(root, step)  # first, to build the restore target
    scan = cfg.train.scan_layers  # a run's checkpoints are in its layout; the model returned is per layer
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    stored = nnx.to_pure_dict(nnx.state(abstract_model(cfg.model, scan=scan)))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), stored)
    with CheckpointManager(root) as mgr:
        restored = mgr.restore(step, params=target)
    params = unstack_layers(restored.params, layer_plan(cfg.model)) if scan else restored.params
    graphdef, state = nnx.split(abstract_model(cfg.model))
    nnx.replace_by_pure_dict(state, params)
    return restored.config, nnx.merge(graphdef, state)


# --------------------------------------------------------------------------------------------
# MXFP4 export


def export_done(dst: str | Path) -> bool:
    """An export is complete at ``dst`` (written atomically locally; its config uploaded last to a bucket)."""
    from jaxmoe.checkpoint.io import CONFIG_FILE  # noqa: PLC0415

    return (resolve(dst) / CONFIG_FILE).exists()


def export_config(cfg: Config) -> tuple[Config | None, str]:
    """The export's config (routed experts in MXFP4) and a note; ``(None, reason)`` if not packable.

    The training mesh is kept when MXFP4 blocks (32 along each contracting dim) divide over it;
    otherwise the config names one device (a checkpoint restores onto any mesh that divides them).
    """
    model = dataclasses.replace(cfg.model, mxfp4_weights=tuple(MXFP4_WEIGHTS))
    out = dataclasses.replace(cfg, model=model)
    try:
        validate(out)
        return out, "training mesh"
    except ConfigError as e:
        out = dataclasses.replace(out, mesh=MeshConfig())
        try:
            validate(out)
        except ConfigError as e1:
            return None, f"skipped: routed experts are not MXFP4-packable ({e1})"
        return out, f"one-device mesh (not packable on the training mesh: {e})"


def write_export(state: dict, cfg: Config, dst: str | Path, tokenizer_file: str | Path | None) -> str:
    """Quantizes the float model state ``state`` (host arrays) and writes the export to ``dst``; returns a note.

    ``tokenizer_file`` is a ``tokenizer.json`` (the tokenizer files beside it, such as
    ``tokenizer_config.json``, are copied with it) or a tokenizer folder; None: no tokenizer. A
    bucket ``dst`` is written locally first and copied up, its ``config.json`` last: an export with
    a config is complete (see :func:`export_done`).
    """
    from jaxmoe.checkpoint.io import CONFIG_FILE, write_checkpoint  # noqa: PLC0415
    from jaxmoe.quant.qarray import quantize_state  # noqa: PLC0415

    dst = resolve(dst)
    if is_uri(dst):
        with tempfile.TemporaryDirectory(prefix="jaxmoe_export_") as tmp:
            local = pathlib.Path(tmp) / "export"
            note = write_export(state, cfg, local, tokenizer_file)
            if local.exists():
                upload_tree(local, dst, last=CONFIG_FILE)
            return note

    out_cfg, note = export_config(cfg)
    if out_cfg is None:
        return note
    packed = jax.tree.map(np.asarray, quantize_state(state, out_cfg.model))
    leaves = jax.tree_util.tree_flatten_with_path(packed)[0]
    arrays = ((tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp), v) for kp, v in leaves)
    write_checkpoint(dst, out_cfg, arrays)
    if tokenizer_file is not None:
        if not copy_tokenizer_files(tokenizer_file, dst):
            raise CheckpointError(f"tokenizer {str(tokenizer_file)!r}: no {TOKENIZER_FILE} there to export")
    return note


def write_sharded_export(state: dict, cfg: Config, dst: str | Path, tokenizer_file: str | Path | None) -> str:
    """:func:`write_export` from every process of a multi-process run, ``state`` the (sharded)
    ``jax.Array`` model state: each process quantizes and writes its own shards
    (:func:`jaxmoe.checkpoint.io.write_sharded_checkpoint`); returns the same note."""
    from jaxmoe.checkpoint.io import write_sharded_checkpoint  # noqa: PLC0415
    from jaxmoe.quant.qarray import quantize_state  # noqa: PLC0415

    out_cfg, note = export_config(cfg)
    if out_cfg is None:
        return note
    extra = {}
    if tokenizer_file is not None:
        extra = {name: file.read_bytes() for file, name in tokenizer_files(tokenizer_file)}
        if TOKENIZER_FILE not in extra:
            raise CheckpointError(f"tokenizer {str(tokenizer_file)!r}: no {TOKENIZER_FILE} there to export")
    write_sharded_checkpoint(dst, out_cfg, quantize_state(state, out_cfg.model), extra)
    return note
