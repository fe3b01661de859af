"""Per-array checksums and verified Orbax restores.

Orbax/TensorStore do not notice a flipped byte inside a compressed array chunk: the chunk decodes
to wrong values and restore succeeds. jaxmoe therefore records, at save time, a 64-bit digest of
every array's exact bits together with its shape and dtype, and recomputes it after every
restore.

The digest (:data:`CHECKSUM_ALGORITHM`) is a sum over elements, so it is computed where the
array lies: each element's bits are mixed with a hash of its global index (two 32-bit lanes of
the murmur3 finaliser, each a bijection of the bits at a given index) and the lanes are summed
modulo 2**32. XLA reduces each device's shard and adds the partial sums (an all-reduce of two
words), so no device, host or process ever holds an array it does not own, and the value does not
depend on the sharding: a checkpoint saved on one mesh verifies on another, or on the host
(:func:`host_digest`, the same formula in numpy, a block of rows at a time). A change to one
element always changes the digest; any other corruption goes unnoticed with probability about
2**-64.

Checkpoints written before this digest carry a CRC-32 of the gathered array (``"crc32"``); they
still verify, the old way.

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
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxmoe.errors import CheckpointError
from jaxmoe.paths import Path

CHECKSUM_ALGORITHM = "digest64"  # the record field; LEGACY_ALGORITHM records are still read
LEGACY_ALGORITHM = "crc32"
_SEEDS = (0x243F6A88, 0x85A308D3)  # one per lane (pi's hex digits)
_GOLDEN = 0x9E3779B1
_HOST_BLOCK = 1 << 24  # elements a host digest mixes at once


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


# --------------------------------------------------------------------------------------------
# The digest: the same integer formula on devices (jnp, sharded) and on the host (numpy)


def _fmix(xp, h):
    """murmur3's 32-bit finaliser (a bijection of uint32), elementwise."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _lane_sums(xp, bits, starts):
    """The two lanes' sums of ``bits`` (uint32, a block of the array whose first element has the
    global index ``starts``): ``sum fmix(bits ^ pos)`` and ``sum fmix(bits + fmix(pos ^ seed))``."""
    pos = xp.uint32(_SEEDS[0])
    for axis, (start, n) in enumerate(zip(starts, bits.shape)):
        iota = xp.arange(start, start + n, dtype=np.uint32).reshape([-1 if a == axis else 1 for a in range(bits.ndim)])
        pos = _fmix(xp, pos * xp.uint32(_GOLDEN) + iota)
    a = xp.sum(_fmix(xp, bits ^ pos), dtype=np.uint32)
    b = xp.sum(_fmix(xp, bits + _fmix(xp, pos ^ xp.uint32(_SEEDS[1]))), dtype=np.uint32)
    return a, b


def _bits(xp, x):
    """``x``'s bits as uint32 (2- and 1-byte types widened; 8-byte ones split into a trailing pair)."""
    itemsize = np.dtype(x.dtype).itemsize
    if itemsize == 8:
        return x.view(np.uint32).reshape(*x.shape, 2) if xp is np else jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    if xp is np:
        return x.view(unsigned).astype(np.uint32)
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _device_digests(tree):
    def one(x):
        bits = _bits(jnp, x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x)
        return jnp.stack(_lane_sums(jnp, bits, (0,) * bits.ndim))

    return jax.tree.map(one, tree)


def _combine(lanes) -> int:
    a, b = (int(v) for v in np.asarray(lanes, dtype=np.uint32))
    return (a << 32) | b


def host_digest(a: np.ndarray) -> int:
    """:data:`CHECKSUM_ALGORITHM` of a host array, a block of leading rows at a time."""
    a = np.asarray(a)
    a = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    a = a.view(np.uint8) if a.dtype == np.bool_ else a
    with np.errstate(over="ignore"):  # the formula wraps modulo 2**32 by design
        if a.ndim == 0:
            return _combine(_lane_sums(np, _bits(np, a.reshape(1))[0], ()))
        rows = max(1, _HOST_BLOCK // max(1, a[:1].size))
        total_a = total_b = np.uint32(0)
        for r in range(0, a.shape[0], rows):
            block = _bits(np, a[r : r + rows])
            da, db = _lane_sums(np, block, (r,) + (0,) * (block.ndim - 1))
            total_a, total_b = total_a + da, total_b + db
    return _combine((total_a, total_b))


def digests(leaves: list) -> list[int]:
    """:data:`CHECKSUM_ALGORITHM` of each array: JAX arrays where they lie (one compiled program
    per set of devices), numpy arrays on the host."""
    out: list[int | None] = [None] * len(leaves)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
        else:
            out[i] = host_digest(x)
    for members in groups.values():
        lanes = _device_digests([leaves[i] for i in members])
        for i, v in zip(members, lanes):
            out[i] = _combine(v.addressable_data(0))  # replicated: every process holds the sums
    return out


def array_record(x) -> dict:
    """``{"digest64": int, "shape": [...], "dtype": str}`` of the exact bits of ``x``."""
    return tree_records({"x": x})["x"]


def tree_records(tree, prefix: str = "") -> dict[str, dict]:
    """:func:`array_record` of every leaf, keyed ``prefix + path`` (device arrays digested in place)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    values = digests([leaf for _, leaf in leaves])
    return {
        prefix + path_str(kp): {
            CHECKSUM_ALGORITHM: v,
            "shape": list(np.shape(leaf)),
            "dtype": str(np.dtype(leaf.dtype)),
        }
        for (kp, leaf), v in zip(leaves, values)
    }


def json_record(value: Any) -> dict:
    """Checksum of a JSON item (data-iterator state, config) in its canonical serialisation."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return {"crc32": zlib.crc32(text.encode()), "json": True}


def verify_tree(tree, records: Mapping[str, dict], checkpoint, prefix: str = "") -> None:
    """Raises :class:`CheckpointError` unless every leaf of ``tree`` has its recorded shape,
    dtype and checksum (``records[prefix + path]``), naming the first array that does not."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [prefix + path_str(kp) for kp, _ in leaves]
    for name in names:
        if records.get(name) is None:
            raise CheckpointError(
                f"checkpoint {str(checkpoint)!r} has no checksum for array {name!r}; refusing to trust it"
            )
    legacy = {n for n in names if CHECKSUM_ALGORITHM not in records[n] and LEGACY_ALGORITHM in records[n]}
    current = [(n, leaf) for n, (_, leaf) in zip(names, leaves) if n not in legacy]
    got = dict(zip((n for n, _ in current), digests([leaf for _, leaf in current])))
    for name, (_, leaf) in zip(names, leaves):
        record = records[name]
        if name in legacy:
            a = to_host(leaf)
            have = {LEGACY_ALGORITHM: zlib.crc32(a.reshape(-1).view(np.uint8)), "shape": list(a.shape)}
            algorithm = LEGACY_ALGORITHM
        else:
            have = {CHECKSUM_ALGORITHM: got[name], "shape": list(np.shape(leaf))}
            algorithm = CHECKSUM_ALGORITHM
        have["dtype"] = str(np.dtype(leaf.dtype))
        for field in ("shape", "dtype", algorithm):
            if have[field] != record.get(field):
                raise CheckpointError(
                    f"checkpoint {str(checkpoint)!r}: array {name!r} is corrupt: {field} {have[field]!r} differs "
                    f"from {record.get(field)!r} recorded at save (the data file changed or was damaged after it "
                    "was written)"
                )


def verify_json(value: Any, record: Mapping | None, name: str, checkpoint) -> None:
    if record is None:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} has no checksum for item {name!r}; refusing to trust it")
    if json_record(value)["crc32"] != record.get("crc32"):
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
    verify_tree(restored, records, checkpoint, prefix)
    return restored
