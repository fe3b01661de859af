"""The tensors of an HF checkpoint folder, read one at a time (``safetensors.safe_open``).

A folder as ``save_pretrained`` writes it: ``model.safetensors``, or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). Nothing is read
until a tensor is asked for, and each read opens its shard, copies that one tensor out and closes
it again, so the HF importer and the streaming converter hold at most the tensors they keep.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np
from safetensors import safe_open

from jaxmoe.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _weight_map(folder: pathlib.Path) -> dict[str, str]:
    """``{tensor name: shard file name}`` of ``folder``."""
    index = folder / INDEX_FILE
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{str(folder)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, "numpy") as f:
        return {k: single.name for k in f.keys()}


class SafetensorsFolder(Mapping):
    """Lazy read-only view of every tensor in an HF folder, as float32 numpy arrays.

    Records which stored tensors were read (``used``) so that the callers can refuse a checkpoint
    holding tensors the model does not use. With ``rename`` every stored name is seen (and
    reported) under ``rename(name)``: one family's names mapped onto another's.

    Attributes:
        stored: ``{tensor name: shard file name}``, every tensor the folder holds.
        used: the names read so far (by ``[]`` or :meth:`raw`).
    """

    def __init__(self, folder: str | os.PathLike, rename: Callable[[str], str] | None = None):
        folder = pathlib.Path(folder)
        self.stored, self._source = {}, {}
        for key, shard in _weight_map(folder).items():
            name = rename(key) if rename is not None else key
            if name in self.stored:
                raise CheckpointError(f"tensors {self._source[name]!r} and {key!r} are the same weight ({name!r})")
            self.stored[name], self._source[name] = shard, key
        self._files = {name: folder / name for name in set(self.stored.values())}
        for path in self._files.values():
            if not path.is_file():
                raise CheckpointError(f"shard {str(path)!r} listed in the index is missing")
        self.used: set[str] = set()

    def _open(self, key: str, framework: str):
        return safe_open(self._files[self.stored[key]], framework)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``, read from the shard's header only."""
        with self._open(key, "numpy") as f:
            return tuple(f.get_slice(self._source[key]).get_shape())

    def raw(self, key: str) -> np.ndarray:
        """The stored tensor ``key`` in its stored dtype (e.g. uint8 MXFP4 blocks)."""
        self.used.add(key)
        with self._open(key, "numpy") as f:
            return f.get_tensor(self._source[key])

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.stored:
            raise KeyError(key)
        self.used.add(key)
        with self._open(key, "flax") as f:  # the flax reader handles bfloat16 (numpy's does not)
            return np.asarray(f.get_tensor(self._source[key]), np.float32)

    def __contains__(self, key) -> bool:
        return key in self.stored

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)


__all__ = ["SafetensorsFolder"]
