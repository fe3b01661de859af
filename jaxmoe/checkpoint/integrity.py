"""Per-array checksums and verified Orbax restores.

Orbax/TensorStore do not notice a flipped byte inside a compressed array chunk: the chunk decodes
to wrong values and restore succeeds. jaxmoe therefore records, at save time, a CRC-32 of every
array's exact bytes (C order, the global array, independent of how it was sharded) together with
its shape and dtype, and recomputes it after every restore. CRC-32 detects every corruption that
touches at most 4 consecutive bytes of an array, and any other with probability 1 - 2**-32.

Cost: computing the CRC brings each array to the host, one array at a time (a gather of the
global value when sharded; ``process_allgather`` when it spans processes), so host memory grows
by at most the largest array; zlib's CRC-32 runs at several GB/s per core.

A pytree directory is read through :func:`restore_pytree`: shapes and dtypes are checked against
the stored metadata first, TensorStore read errors (a truncated or damaged file) are re-raised
naming the arrays that cannot be read, and every restored array is checksummed, so a restore
either returns the saved bits or raises :class:`CheckpointError` naming the array and checkpoint.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxmoe.errors import CheckpointError
from jaxmoe.paths import Path

CHECKSUM_ALGORITHM = "crc32"


def path_str(keypath) -> str:
    """``('layers', 1, 'ffn', 'w_up')`` or a JAX key path -> ``'layers/1/ffn/w_up'``."""
    if keypath and not isinstance(keypath[0], (str, int)):
        return jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")
    return "/".join(str(k) for k in keypath)


def to_host(x) -> np.ndarray:
    """The global value of ``x`` as a C-contiguous numpy array (gathered if sharded)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415 (multi-process only)

        x = multihost_utils.process_allgather(x, tiled=True)
    a = np.asarray(x)
    # (np.ascontiguousarray would turn a 0-d array into shape (1,).)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def array_record(x) -> dict:
    """``{"crc32": int, "shape": [...], "dtype": str}`` of the exact bytes of ``x``."""
    a = to_host(x)
    return {
        CHECKSUM_ALGORITHM: zlib.crc32(a.reshape(-1).view(np.uint8)),
        "shape": list(a.shape),
        "dtype": str(a.dtype),
    }


def json_record(value: Any) -> dict:
    """Checksum of a JSON item (data-iterator state, config) in its canonical serialisation."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return {CHECKSUM_ALGORITHM: zlib.crc32(text.encode()), "json": True}


def tree_records(tree, prefix: str = "") -> dict[str, dict]:
    """:func:`array_record` of every leaf, keyed ``prefix + path`` (host copies one at a time)."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[prefix + path_str(keypath)] = array_record(leaf)
    return out


def verify_array(value, record: Mapping | None, name: str, checkpoint) -> None:
    """Raises :class:`CheckpointError` unless ``value`` has the recorded shape, dtype and CRC."""
    if record is None:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} has no checksum for array {name!r}; refusing to trust it"
        )
    got = array_record(value)
    for field in ("shape", "dtype", CHECKSUM_ALGORITHM):
        if got[field] != record[field]:
            raise CheckpointError(
                f"checkpoint {str(checkpoint)!r}: array {name!r} is corrupt: {field} {got[field]!r} differs from "
                f"{record[field]!r} recorded at save (the data file changed or was damaged after it was written)"
            )


def verify_json(value: Any, record: Mapping | None, name: str, checkpoint) -> None:
    if record is None:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} has no checksum for item {name!r}; refusing to trust it")
    if json_record(value)[CHECKSUM_ALGORITHM] != record[CHECKSUM_ALGORITHM]:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: item {name!r} is corrupt: its checksum differs from save"
        )


def pytree_dir(item: Path) -> Path:
    """The Orbax pytree directory of an item (Orbax v1 partial saves nest it under ``state/``)."""
    for d in (item, item / "state"):
        if (d / "_METADATA").is_file():
            return d
    raise CheckpointError(
        f"{str(item)!r} is not an Orbax pytree checkpoint (no _METADATA); it is incomplete or not one"
    )


def _pytree_checkpointer() -> ocp.Checkpointer:
    """An Orbax pytree checkpointer that takes an existing item directory as complete, in a bucket too.

    The directories read here lie inside a unit whose completeness is already established (a
    model checkpoint: its ``config.json``, renamed into place or uploaded last; a training step:
    listed by Orbax as finalized), so Orbax's own marker is not asked for again. On GCS that marker
    is a ``commit_success.txt`` in the directory itself, which Orbax writes only at the top of what
    it finalizes (a step, a partial save's ``params/``), never in the pytree directory below it.
    """
    return ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(), temporary_path_class=ocp.path.atomicity.AtomicRenameTemporaryPath
    )


def stored_arrays(directory: Path, checkpoint) -> dict[str, tuple[tuple, tuple[int, ...], np.dtype]]:
    """``{path: (stored key path, shape, dtype)}`` of every array in an Orbax pytree directory."""
    try:
        with _pytree_checkpointer() as ckptr:
            tree = ckptr.metadata(directory).item_metadata.tree
    except Exception as e:  # noqa: BLE001 (any failure to parse the metadata is a damaged checkpoint)
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: cannot read the array metadata in {directory}: {e}"
        ) from e
    out = {}
    for keypath, meta in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in keypath)
        out[path_str(keys)] = (keys, tuple(meta.shape), np.dtype(meta.dtype))
    return out


def _restore_args(spec):
    if getattr(spec, "sharding", None) is None:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=spec.dtype)
    return ocp.ArrayRestoreArgs(sharding=spec.sharding, global_shape=spec.shape, dtype=spec.dtype)


def _raw_restore(directory: Path, target):
    with _pytree_checkpointer() as ckptr:
        return ckptr.restore(
            directory,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=jax.tree.map(_restore_args, target), partial_restore=True
            ),
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


def _nested(keys: tuple, leaf) -> dict:
    for k in reversed(keys):
        leaf = {k: leaf}
    return leaf


def restore_pytree(directory: Path, target, records: Mapping[str, dict], *, checkpoint, prefix: str = ""):
    """Restores ``target`` (a pytree of ``jax.ShapeDtypeStruct``) from an Orbax pytree directory.

    A leaf with a sharding is restored as a ``jax.Array`` with that sharding (the checkpoint may
    have been written on any mesh); a leaf whose sharding is None comes back as a host numpy array.
    Every array is checked against ``records[prefix + path]`` (shape and dtype before reading,
    the checksum after); the records, not Orbax's own metadata, are the authority, so a damaged
    metadata file is reported per array as well.

    Raises:
        CheckpointError: naming the checkpoint and the array that is missing, has another shape
            or dtype, cannot be read, or fails its checksum.
    """
    leaves = jax.tree_util.tree_flatten_with_path(target)[0]
    for keypath, spec in leaves:
        name = prefix + path_str(keypath)
        record = records.get(name)
        if record is None:
            raise CheckpointError(f"checkpoint {str(checkpoint)!r} has no array {name!r}")
        shape, dtype = tuple(record["shape"]), np.dtype(record["dtype"])
        if shape != tuple(spec.shape) or dtype != np.dtype(spec.dtype):
            raise CheckpointError(
                f"checkpoint {str(checkpoint)!r}: array {name!r} is stored as {dtype} {shape}, "
                f"the restore target expects {np.dtype(spec.dtype)} {tuple(spec.shape)}"
            )
    try:
        restored = _raw_restore(directory, target)
    except Exception as e:  # noqa: BLE001 (TensorStore raises plain Exceptions; find the arrays behind it)
        bad = []
        for keypath, spec in leaves:
            keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in keypath)
            try:
                _raw_restore(directory, _nested(keys, spec))
            except Exception as leaf_error:  # noqa: BLE001
                bad.append((prefix + path_str(keypath), _first_line(leaf_error)))
        if not bad:
            raise CheckpointError(f"checkpoint {str(checkpoint)!r} cannot be restored: {_first_line(e)}") from e
        names = ", ".join(repr(n) for n, _ in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: cannot read array {names} ({len(bad)} of {len(leaves)} arrays); "
            f"the data files are truncated or damaged: {bad[0][1]}"
        ) from e
    for keypath, value in jax.tree_util.tree_flatten_with_path(restored)[0]:
        name = prefix + path_str(keypath)
        verify_array(value, records.get(name), name, checkpoint)
    return restored
