"""Training checkpoints: Orbax ``CheckpointManager`` with async save, keep-N and verified restore.

One step holds everything needed to resume::

    ROOT/<step>/params       Orbax pytree (model state; MXFP4 weights as uint8 blocks/scales)
    ROOT/<step>/opt_state    Orbax pytree (optimizer state), optional
    ROOT/<step>/data_state   JSON (data-iterator state), optional
    ROOT/<step>/config       JSON (the typed config)
    ROOT/<step>/checksums    JSON: digest, shape, dtype of every array ("params/...", "opt_state/...")
                             and of the JSON items

Orbax writes a step into a temporary directory and renames it when every item is complete, so a
save killed mid-write is never listed and the previous step stays restorable; the next manager
on the same root removes the leftover. Checksums are computed when :meth:`CheckpointManager.save`
is called, on the devices that hold each array's shards (:mod:`jaxmoe.checkpoint.integrity`: no
array is gathered, by any process); the write itself then runs in the background.

Restore targets an abstract tree of ``jax.ShapeDtypeStruct`` with shardings (or arrays, whose
shardings are used), so a step written on one mesh restores onto another or onto one device, bit
for bit; any damaged array raises :class:`CheckpointError` naming it and the step directory.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxmoe.checkpoint.integrity import json_record, restore_pytree, tree_records, verify_json
from jaxmoe.config import Config, from_config_dict
from jaxmoe.errors import CheckpointError
from jaxmoe.paths import Path, resolve

PYTREE_ITEMS = ("params", "opt_state")
JSON_ITEMS = ("data_state", "config")
CHECKSUMS_ITEM = "checksums"


@dataclasses.dataclass
class Restored:
    """What one step holds: ``params`` and ``opt_state`` pytrees, ``data_state`` (JSON) and ``config``."""

    step: int
    params: Any
    opt_state: Any
    data_state: Any
    config: Config


def abstract_target(tree):
    """Arrays or ``ShapeDtypeStruct``s -> ``ShapeDtypeStruct``s carrying each leaf's sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


class CheckpointManager:
    """Saves and restores training steps under ``directory``.

    Args:
        directory: the checkpoint root (created if missing).
        max_to_keep: keep the newest N steps (None keeps all).
        save_interval_steps: :meth:`save` skips steps that are not a multiple of this (unless forced).
        async_save: write in the background; :meth:`save` returns once the arrays are checksummed.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = resolve(directory)  # a bucket (gs://...) stays one
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._mgr = ocp.CheckpointManager(
            self.directory, item_names=(*PYTREE_ITEMS, *JSON_ITEMS, CHECKSUMS_ITEM), options=options
        )

    # --- listing -------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Completely written steps, oldest first (an interrupted save is not among them)."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    # --- save ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        params,
        config: Config,
        opt_state=None,
        data_state: Any = None,
        force: bool = False,
    ) -> bool:
        """Starts saving one step; returns False if ``save_interval_steps`` skips it.

        ``data_state`` must be JSON-serialisable (e.g. ``{"epoch": 0, "position": 1234}``).
        """
        if not force and not self._mgr.should_save(step):
            return False
        config_dict = dataclasses.asdict(config)
        records = tree_records(params, "params/")
        items = {
            "params": ocp.args.StandardSave(params),
            "config": ocp.args.JsonSave(config_dict),
        }
        records["config"] = json_record(config_dict)
        if opt_state is not None:
            records.update(tree_records(opt_state, "opt_state/"))
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        if data_state is not None:
            records["data_state"] = json_record(data_state)
            items["data_state"] = ocp.args.JsonSave(data_state)
        items[CHECKSUMS_ITEM] = ocp.args.JsonSave(records)
        return self._mgr.save(step, args=ocp.args.Composite(**items), force=force)

    def wait_until_finished(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- restore -------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, params, opt_state=None) -> Restored:
        """Restores ``step`` (default: the latest) onto the shardings of the given targets.

        Args:
            params: abstract target (``ShapeDtypeStruct`` with shardings, or arrays) of the params.
            opt_state: same for the optimizer state; None skips it (e.g. for inference).

        Raises:
            CheckpointError: no such step, or an item or array is missing, mismatched or damaged.
        """
        self._mgr.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"checkpoint root {str(self.directory)!r} holds no complete step")
        if step not in self.all_steps():
            raise CheckpointError(
                f"checkpoint root {str(self.directory)!r} has no complete step {step}: {self.all_steps()}"
            )
        where = self.step_dir(step)
        present = {p.name for p in where.iterdir()}
        records = self._json(step, CHECKSUMS_ITEM, present, where)
        config_dict = self._json(step, "config", present, where)
        verify_json(config_dict, records.get("config"), "config", where)
        data_state = None
        if "data_state" in records:
            data_state = self._json(step, "data_state", present, where)
            verify_json(data_state, records["data_state"], "data_state", where)
        out = {}
        for item, target in (("params", params), ("opt_state", opt_state)):
            if target is None:
                out[item] = None
                continue
            if item not in present:
                raise CheckpointError(f"checkpoint {str(where)!r} has no {item!r} item")
            out[item] = restore_pytree(
                where / item, abstract_target(target), records, checkpoint=where, prefix=f"{item}/"
            )
        return Restored(step, out["params"], out["opt_state"], data_state, from_config_dict(config_dict))

    def _json(self, step: int, item: str, present: set[str], where: pathlib.Path):
        if item not in present:
            raise CheckpointError(f"checkpoint {str(where)!r} has no {item!r} item")
        try:
            restored = self._mgr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
        except Exception as e:  # noqa: BLE001 (a damaged JSON item: report which)
            raise CheckpointError(f"checkpoint {str(where)!r}: item {item!r} cannot be read: {e}") from e
        return restored[item]
