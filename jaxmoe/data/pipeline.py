"""Token streams for training and evaluation, and the packed, resumable batch iterator.

``build_token_data`` turns the corpus into two 1-D int32 token streams (train and held-out; the
documents of a split joined with eos between them) and the tokenizer trained on the train split
(:class:`jaxmoe.chat.tokenizer.Tokenizer`: HF tokenizers' byte-level BPE with the native chat
format's special tokens), cached on disk. ``PackedBatches`` cuts a stream into windows of
``seq_len + 1`` tokens, taken with stride ``seq_len`` (window ``i`` is
``tokens[i*seq_len : i*seq_len + seq_len + 1]``; neighbours share one token, so every token after
the first is a target exactly once per epoch), and serves them in a fresh permutation each epoch.
``heldout_batches`` gives fixed evaluation batches of the same windows in order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping

import numpy as np

from jaxmoe.chat.format import NATIVE_SPECIAL_TOKENS
from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.data.corpus import CORPUS_SOURCE, Document, python_stdlib_documents, split_documents

_CACHE_FORMAT = 2  # bump when the tokenizer, corpus rules or stream layout change (2: HF tokenizers)
MIN_VOCAB = 256 + len(NATIVE_SPECIAL_TOKENS)  # the 256 bytes and the special tokens


@dataclasses.dataclass
class TokenData:
    """Token streams and the tokenizer that made them.

    Attributes:
        train: ``[N_train]`` int32, the train documents' tokens with eos between documents.
        heldout: ``[N_heldout]`` int32, the same for the held-out documents.
        tokenizer: trained on the train documents only.
        source: where the text comes from, its licence, and what was selected.
    """

    train: np.ndarray
    heldout: np.ndarray
    tokenizer: Tokenizer
    source: str


def _token_stream(tokenizer: Tokenizer, docs: list[Document]) -> np.ndarray:
    eos = np.asarray([tokenizer.eos_id], np.int32)
    parts: list[np.ndarray] = []
    for i, ids in enumerate(tokenizer.encode_batch([d.text for d in docs])):
        if i:
            parts.append(eos)
        parts.append(np.asarray(ids, np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _cache_key(params: dict, docs: list[Document]) -> str:
    h = hashlib.sha256(json.dumps({"format": _CACHE_FORMAT, **params}, sort_keys=True).encode())
    for doc in docs:  # names and contents: a changed interpreter or edited file gives a new entry
        h.update(doc.name.encode("utf-8") + b"\0")
        h.update(hashlib.sha256(doc.text.encode("utf-8")).digest())
    return h.hexdigest()[:24]


def _load_cached(path: pathlib.Path) -> TokenData:
    meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    streams = {}
    for name in ("train", "heldout"):
        arr = np.load(path / f"{name}.npy", allow_pickle=False)
        if arr.dtype != np.int32 or arr.ndim != 1:
            raise ValueError(f"{path / name}.npy: expected a 1-D int32 array, got {arr.dtype} {arr.shape}")
        streams[name] = arr
    return TokenData(tokenizer=Tokenizer.load(path), source=meta["source"], **streams)


def build_token_data(
    *, vocab_size: int, max_bytes: int, heldout_fraction: float, cache_dir: str | os.PathLike
) -> TokenData:
    """Corpus -> train/held-out split -> tokenizer trained on train -> both splits encoded; cached.

    The result is stored under ``cache_dir/<key>/`` (``tokenizer.json``, ``tokenizer_config.json``,
    ``train.npy``, ``heldout.npy``, ``meta.json``), ``key`` hashing the arguments and the selected
    files' names and contents. It is written to a temporary directory and renamed into place, so a
    present entry is always complete and concurrent builders (several hosts, say) cannot leave a
    half-written one; a present entry is loaded instead of rebuilt.

    Args:
        vocab_size: tokenizer vocabulary (>= 267: 256 bytes + 11 special tokens).
        max_bytes: cap on the corpus text taken (see :func:`python_stdlib_documents`).
        heldout_fraction: fraction of documents held out, in (0, 1).
        cache_dir: where cached entries live (created if missing).

    Returns:
        The token streams, tokenizer and a description of the source.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be an int >= {MIN_VOCAB} (256 bytes + {len(NATIVE_SPECIAL_TOKENS)} special tokens), "
            f"got {vocab_size!r}"
        )
    docs = python_stdlib_documents(max_bytes)
    train_docs, heldout_docs = split_documents(docs, heldout_fraction)
    params = {"vocab_size": vocab_size, "max_bytes": max_bytes, "heldout_fraction": float(heldout_fraction)}
    cache_dir = pathlib.Path(cache_dir)
    final = cache_dir / _cache_key(params, docs)
    if final.is_dir():
        return _load_cached(final)

    tokenizer = Tokenizer.train((d.text for d in train_docs), vocab_size)
    n_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
    source = (
        f"{CORPUS_SOURCE} Selected: the first {len(docs)} files by name ({n_bytes} bytes, max_bytes={max_bytes}); "
        f"{len(heldout_docs)} held out by name hash (heldout_fraction={heldout_fraction})."
    )
    data = TokenData(
        train=_token_stream(tokenizer, train_docs),
        heldout=_token_stream(tokenizer, heldout_docs),
        tokenizer=tokenizer,
        source=source,
    )

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        tokenizer.save(tmp)
        np.save(tmp / "train.npy", data.train)
        np.save(tmp / "heldout.npy", data.heldout)
        meta = {"source": source, **params, "heldout_documents": [d.name for d in heldout_docs]}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process renamed its (identical) entry into place first; keep that one.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return data


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_tokens(tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} with shape {tokens.shape}")
    return tokens.astype(np.int32, copy=False)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """``[len(starts), seq_len + 1]`` int32: the windows of ``tokens`` beginning at ``starts``."""
    return tokens[starts[:, None] + np.arange(seq_len + 1)]


class PackedBatches:
    """Endless, deterministic, resumable batches of packed windows from one token stream.

    Windows: ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` for ``i < (len(tokens) - 1) // seq_len``
    (stride ``seq_len``, so each token after the first is a target once per epoch; a tail shorter than a
    window is unused). Epoch ``e`` visits the windows in the order ``np.random.default_rng([seed,
    e]).permutation(num_windows)``; a batch takes the next ``batch_size`` windows, continuing into the
    next epoch when one ends. Each batch is ``[batch_size, seq_len + 1]`` int32: inputs ``[:, :-1]``,
    targets ``[:, 1:]``.

    ``state()`` is a JSON-able dict; ``restore(state)`` continues exactly where that state was taken.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int):
        self._tokens = _check_tokens(tokens)
        self.seq_len = _check_positive_int("seq_len", seq_len)
        self.batch_size = _check_positive_int("batch_size", batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.seed = int(seed)
        self.num_windows = (len(self._tokens) - 1) // self.seq_len if len(self._tokens) else 0
        if self.num_windows < self.batch_size:
            need = self.batch_size * self.seq_len + 1
            raise ValueError(
                f"tokens: {len(self._tokens)} tokens are too few for one batch of batch_size={self.batch_size} "
                f"windows of seq_len + 1 = {self.seq_len + 1} tokens; at least {need} are needed"
            )
        self._epoch = 0
        self._position = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, np.int64)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, self._epoch]).permutation(self.num_windows)
            self._perm_epoch = self._epoch
        return self._perm

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> np.ndarray:
        parts = []
        need = self.batch_size
        while need:
            take = min(need, self.num_windows - self._position)
            parts.append(self._permutation()[self._position : self._position + take])
            self._position += take
            need -= take
            if self._position == self.num_windows:
                self._epoch += 1
                self._position = 0
        return _windows(self._tokens, np.concatenate(parts) * self.seq_len, self.seq_len)

    def state(self) -> dict:
        """The iterator's position and identity, JSON-serialisable."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_tokens": self.num_tokens,
        }

    def restore(self, state: Mapping) -> None:
        """Continues from ``state`` (from :meth:`state`); its seed is adopted.

        Raises:
            ValueError: naming the field, if ``state`` lacks a field, has a non-int one, or its
                ``seq_len``, ``batch_size`` or ``num_tokens`` differ from this iterator's.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"state must be a dict from PackedBatches.state(), got {type(state).__name__}")
        fields = ("epoch", "position", "seed", "seq_len", "batch_size", "num_tokens")
        for name in fields:
            if name not in state:
                raise ValueError(f"state is missing field {name!r} (expected fields: {', '.join(fields)})")
            value = state[name]
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"state[{name!r}] must be an int, got {value!r}")
        for name in ("seq_len", "batch_size", "num_tokens"):
            mine = getattr(self, name)
            if int(state[name]) != mine:
                raise ValueError(f"state[{name!r}] = {int(state[name])} does not match this iterator's {name} = {mine}")
        if state["epoch"] < 0:
            raise ValueError(f"state['epoch'] must be >= 0, got {state['epoch']}")
        if not 0 <= state["position"] < self.num_windows:
            raise ValueError(f"state['position'] must be in [0, {self.num_windows}), got {state['position']}")
        if state["seed"] < 0:
            raise ValueError(f"state['seed'] must be >= 0, got {state['seed']}")
        self.seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._perm_epoch = -1


def heldout_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, num_batches: int) -> list[np.ndarray]:
    """Fixed evaluation batches: the first ``num_batches * batch_size`` windows of ``tokens``, in order.

    Windows are those of :class:`PackedBatches` (stride ``seq_len``). Returns ``num_batches`` int32 arrays
    ``[batch_size, seq_len + 1]``.
    """
    tokens = _check_tokens(tokens)
    seq_len = _check_positive_int("seq_len", seq_len)
    batch_size = _check_positive_int("batch_size", batch_size)
    num_batches = _check_positive_int("num_batches", num_batches)
    windows = num_batches * batch_size
    need = windows * seq_len + 1
    if len(tokens) < need:
        raise ValueError(
            f"tokens: {len(tokens)} held-out tokens are too few for num_batches={num_batches} x batch_size="
            f"{batch_size} windows of seq_len + 1 = {seq_len + 1}; at least {need} are needed"
        )
    all_windows = _windows(tokens, np.arange(windows) * seq_len, seq_len)
    return [all_windows[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]
