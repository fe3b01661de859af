"""Model checkpoints: a directory holding the typed config, the parameters (Orbax) and checksums.

Layout of ``DIR``::

    DIR/config.json      the typed config (dataclasses.asdict); model.mxfp4_weights names packed weights
    DIR/checksums.json   {"format", "algorithm": "digest64", "arrays": {path: {digest64, shape, dtype}}}
    DIR/params/          an Orbax pytree: nnx.to_pure_dict(nnx.state(model)); an MXFP4 weight is the
                         subtree {"blocks": uint8, "scales": uint8} under the weight's name

Writes are streamed and atomic: :class:`ArrayTreeWriter` adds arrays one at a time (Orbax partial
saves, grouped up to ``group_bytes``) into ``.DIR.incomplete`` next to ``DIR``, which is renamed to
``DIR`` only when everything, checksums included, is on disk. A killed writer therefore leaves no
``DIR``, only the staging directory, which the next write to ``DIR`` removes.

Reads (:class:`CheckpointReader`, :func:`load_model`) take a local directory or a bucket
(``gs://B/P``) alike and read it where it lies, through ``etils.epath`` and Orbax, with no local
copy. They are verified (:mod:`jaxmoe.checkpoint.integrity`): every array's digest is checked, and a
damaged checkpoint raises :class:`CheckpointError` naming the array and the checkpoint. Restore
targets the abstract model with shardings, so a checkpoint written on one mesh restores onto
another (or onto one device). Checkpoints here are written by one process (multi-host training
uses :class:`jaxmoe.checkpoint.manager.CheckpointManager`), except :func:`write_sharded_checkpoint`,
which every process of a multi-process run calls with the same sharded tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import shutil
from collections.abc import Iterable, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint.experimental.v1 import partial as ocp_partial

from jaxmoe.checkpoint.integrity import (
    CHECKSUM_ALGORITHM,
    LEGACY_ALGORITHM,
    array_record,
    path_str,
    pytree_dir,
    restore_pytree,
    stored_arrays,
    to_host,
    tree_records,
)
from jaxmoe.config import Config, ConfigError, from_config_dict
from jaxmoe.errors import CheckpointError
from jaxmoe.paths import Path, is_uri, resolve
from jaxmoe.sharding import state_shardings

CONFIG_FILE = "config.json"
CHECKSUMS_FILE = "checksums.json"
PARAMS_DIR = "params"
FORMAT = "jaxmoe-checkpoint/1"
GROUP_BYTES = 64 << 20  # small arrays are batched into one Orbax write up to this size


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _insert(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    if path[-1] in tree:
        raise CheckpointError(f"array {path_str(path)!r} was written twice")
    tree[path[-1]] = value


class ArrayTreeWriter:
    """Writes a pytree of arrays leaf by leaf into an Orbax pytree directory, recording checksums.

    Host memory holds at most the arrays of one pending group (``group_bytes``) plus the array
    being added, so a checkpoint larger than memory can be written from a stream of tensors.

    Args:
        directory: the new item directory (must not exist); Orbax stages in ``<directory>.partial_save``.
        group_bytes: arrays are flushed to disk once the pending ones exceed this many bytes.
    """

    def __init__(self, directory: pathlib.Path, group_bytes: int = GROUP_BYTES):
        self.directory = pathlib.Path(directory)
        self.group_bytes = group_bytes
        self.records: dict[str, dict] = {}
        self._pending: dict = {}
        self._pending_bytes = 0

    def add(self, path: tuple, value) -> None:
        """Queues ``value`` (numpy or single-process JAX array) under ``path`` (a tuple of keys)."""
        value = to_host(value)
        name = path_str(path)
        if name in self.records:
            raise CheckpointError(f"array {name!r} was written twice")
        self.records[name] = array_record(value)
        _insert(self._pending, tuple(path), value)
        self._pending_bytes += value.nbytes
        if self._pending_bytes >= self.group_bytes:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            ocp_partial.save(self.directory, self._pending)
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, dict]:
        """Writes what is pending and finalises the Orbax checkpoint; returns the checksum records."""
        self.flush()
        if not self.records:
            raise CheckpointError(f"no arrays were written to {str(self.directory)!r}")
        ocp_partial.finalize(self.directory)
        return self.records


@contextlib.contextmanager
def staged_checkpoint(dst: str | pathlib.Path) -> Iterator[pathlib.Path]:
    """Yields a staging directory that becomes ``dst`` (atomically, by rename) if the block succeeds."""
    dst = pathlib.Path(dst).absolute()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"checkpoint {str(dst)!r} already exists; choose a new destination")
    staging = dst.parent / f".{dst.name}.incomplete"
    if staging.exists():
        shutil.rmtree(staging)  # left by a writer that was killed
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()  # empty (checked above)
    os.replace(staging, dst)


@contextlib.contextmanager
def checkpoint_writer(
    dst: str | pathlib.Path, cfg: Config, group_bytes: int = GROUP_BYTES
) -> Iterator[ArrayTreeWriter]:
    """Yields an :class:`ArrayTreeWriter` for the params of a new checkpoint ``dst``.

    When the block ends without error the params are finalised, ``config.json`` and
    ``checksums.json`` written, and the staging directory renamed to ``dst``.
    """
    with staged_checkpoint(dst) as staging:
        writer = ArrayTreeWriter(staging / PARAMS_DIR, group_bytes)
        yield writer
        records = writer.close()
        (staging / CONFIG_FILE).write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
        checksums = {"format": FORMAT, "algorithm": CHECKSUM_ALGORITHM, "arrays": records}
        (staging / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1) + "\n")


def write_checkpoint(
    dst: str | pathlib.Path, cfg: Config, arrays: Iterable[tuple[tuple, object]], group_bytes: int = GROUP_BYTES
) -> pathlib.Path:
    """Writes a model checkpoint from a stream of ``(path, array)`` pairs; returns its absolute path."""
    dst = pathlib.Path(dst).absolute()
    with checkpoint_writer(dst, cfg, group_bytes) as writer:
        for path, value in arrays:
            writer.add(path, value)
    return dst


def write_sharded_checkpoint(dst: str | Path, cfg: Config, params, extra_files: dict[str, bytes] | None = None) -> None:
    """Writes a model checkpoint from every process at once: each writes the shards it holds.

    ``params`` is a pytree of ``jax.Array`` (sharded over any mesh, possibly spanning processes);
    every process calls this with the same tree. Orbax writes each process's addressable shards
    (one copy of each replicated shard), the digests are computed where the shards lie
    (:func:`jaxmoe.checkpoint.integrity.tree_records`), so no process holds an array it does not
    own. Process 0 then writes ``checksums.json``, the ``extra_files`` (e.g. the tokenizer's) and
    ``config.json`` last. A local ``dst`` (one filesystem seen by every process) is staged in
    ``.DIR.incomplete`` and renamed into place; in a bucket, ``config.json`` marks it complete.
    """
    from jax.experimental import multihost_utils  # noqa: PLC0415

    dst = resolve(dst)
    main = jax.process_index() == 0
    local = not is_uri(dst)
    if local:
        dst = pathlib.Path(dst).absolute()
        if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
            raise FileExistsError(f"checkpoint {str(dst)!r} already exists; choose a new destination")
        staging = dst.parent / f".{dst.name}.incomplete"
        if main:
            shutil.rmtree(staging, ignore_errors=True)  # left by a writer that was killed
            staging.mkdir(parents=True)
    else:
        staging = dst
    multihost_utils.sync_global_devices("jaxmoe_sharded_checkpoint_staged")
    records = tree_records(params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(staging / PARAMS_DIR, params)
        ckptr.wait_until_finished()
    if main:
        checksums = {"format": FORMAT, "algorithm": CHECKSUM_ALGORITHM, "arrays": records}
        (staging / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1) + "\n")
        for name, data in (extra_files or {}).items():
            (staging / name).write_bytes(data)
        (staging / CONFIG_FILE).write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
        if local:
            if dst.exists():
                dst.rmdir()  # empty (checked above)
            os.replace(staging, dst)
    multihost_utils.sync_global_devices("jaxmoe_sharded_checkpoint_done")


def save_model(model: nnx.Module, cfg: Config, path: str | pathlib.Path) -> pathlib.Path:
    """Writes ``path/{config.json, checksums.json, params}``; refuses to overwrite an existing checkpoint.

    Arrays go to the host one at a time (sharded ones are gathered), so host memory grows by
    about :data:`GROUP_BYTES` plus the largest array.
    """
    state = nnx.to_pure_dict(nnx.state(model))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    keys = (tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp) for kp, _ in leaves)
    return write_checkpoint(path, cfg, ((k, leaf) for k, (_, leaf) in zip(keys, leaves)))


def load_config_from_checkpoint(path: str | os.PathLike) -> Config:
    path = resolve(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ConfigError(f"{str(path)!r} is not a jaxmoe checkpoint: it has no {CONFIG_FILE}")
    try:
        values = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {CONFIG_FILE} is not valid JSON ({e})") from e
    return from_config_dict(values)


def load_checksums(path: Path) -> dict[str, dict]:
    """The per-array records of the model checkpoint at ``path``."""
    file = path / CHECKSUMS_FILE
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no {CHECKSUMS_FILE}: it is incomplete or predates checksums"
        )
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {CHECKSUMS_FILE} is damaged ({e})") from e
    if data.get("format") != FORMAT or data.get("algorithm") not in (CHECKSUM_ALGORITHM, LEGACY_ALGORITHM):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {CHECKSUMS_FILE} has format {data.get('format')!r} / algorithm "
            f"{data.get('algorithm')!r}; this jaxmoe reads {FORMAT!r} / {CHECKSUM_ALGORITHM!r} "
            f"(or {LEGACY_ALGORITHM!r})"
        )
    return data["arrays"]


def _params_dir(path: Path) -> Path:
    if not (path / PARAMS_DIR).exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no {PARAMS_DIR}/ directory")
    return pytree_dir(path / PARAMS_DIR)


class CheckpointReader:
    """Reads a model checkpoint, local or in a bucket (``gs://``), where it lies: no copy is made.

    Orbax reads the small files through ``etils.epath`` and the arrays through tensorstore's own
    drivers; every array is checked against its recorded digest, shape and dtype. :meth:`restore`
    reads a whole tree (onto the target's shardings), :meth:`read` one array onto the host (for
    streaming conversion).

    Attributes:
        path: the checkpoint directory (absolute, or the bucket URI).
        cfg: the checkpoint's typed config.
        records: the checksum records, ``{array path: {digest64, shape, dtype}}``.
        arrays: ``{path: (stored key path, shape, dtype)}`` in storage order (read on first use).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = resolve(path)
        self.cfg = load_config_from_checkpoint(self.path)
        self._dir = _params_dir(self.path)
        self.records = load_checksums(self.path)

    @functools.cached_property
    def arrays(self) -> dict[str, tuple[tuple, tuple[int, ...], np.dtype]]:
        return stored_arrays(self._dir, self.path)

    def read(self, name: str) -> np.ndarray:
        """The array ``name`` (e.g. ``'layers/1/ffn/w_up/blocks'``) as numpy, checksum verified."""
        keys, shape, dtype = self.arrays[name]
        target = jax.ShapeDtypeStruct(shape, dtype)
        for k in reversed(keys):
            target = {k: target}
        return jax.tree.leaves(restore_pytree(self._dir, target, self.records, checkpoint=self.path))[0]

    def restore(self, target):
        """The params as ``target`` (a pytree of ``jax.ShapeDtypeStruct``, see :func:`restore_pytree`).

        Raises:
            CheckpointError: the checkpoint holds arrays that ``target`` lacks, or one of ``target``'s
                arrays is missing, mismatched or damaged.
        """
        wanted = {path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
        extra = sorted(set(self.records) - wanted)
        if extra:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r} holds {len(extra)} arrays its config's model does not have, "
                f"e.g. {extra[:3]}"
            )
        return restore_pytree(self._dir, target, self.records, checkpoint=self.path)


def load_model(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None):
    """Restores ``(cfg, model)`` from a local or ``gs://`` checkpoint; parameters are placed by the
    sharding rules on ``mesh`` (or on one device).

    Raises:
        CheckpointError: the checkpoint is incomplete, holds other arrays than the config's model,
            or an array is damaged (named with the checkpoint).
    """
    from jaxmoe.model import abstract_model  # noqa: PLC0415 (model imports every module)

    reader = CheckpointReader(path)
    graphdef, abstract_state = nnx.split(abstract_model(reader.cfg.model))
    if mesh is None:
        device = jax.local_devices()[0]  # this process's own copy (jax.devices()[0] is process 0's)
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), abstract_state)
    else:
        shardings = state_shardings(abstract_state, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract_state),
        nnx.to_pure_dict(shardings),
    )
    nnx.replace_by_pure_dict(abstract_state, reader.restore(target))
    return reader.cfg, nnx.merge(graphdef, abstract_state)
