"""A byte-level BPE tokenizer, trained locally.

Ids: ``0..255`` are the raw bytes, ``256`` is the special ``<|endoftext|>`` (eos) token, and
``257 + i`` is the token made by the ``i``-th merge. Text is first cut into pieces by a simple
regex (words, numbers, punctuation runs, whitespace runs; a word, number or punctuation run takes
one leading space) and merges never cross a piece boundary, so training only needs the unique
pieces and their counts, and encoding caches the ids of each piece.

Every string encodes to bytes that decode back to it exactly. ``encode`` never produces eos (the
text ``"<|endoftext|>"`` is encoded literally); callers put ``eos_id`` between documents.
"""

from __future__ import annotations

import collections
import heapq
import json
import os
import re
from collections.abc import Iterable, Sequence

from jaxmoe.paths import resolve

_PATTERN = r" ?[^\W\d]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+"
_SPLIT = re.compile(_PATTERN)
_NUM_BYTES = 256
EOS_TOKEN = "<|endoftext|>"
_FORMAT = "jaxmoe-byte-bpe"
_VERSION = 1


def _pieces(text: str) -> list[str]:
    """Cut ``text`` into pre-tokenisation pieces; their concatenation is ``text``."""
    return _SPLIT.findall(text)


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace the non-overlapping occurrences of ``pair`` in ``ids``, left to right, by ``new_id``."""
    a, b = pair
    out = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _learn_merges(pieces: dict[str, int], num_merges: int) -> tuple[list[tuple[int, int]], dict[str, list[int]]]:
    """Learn up to ``num_merges`` merges from piece counts; also return each piece's final ids.

    The most frequent adjacent pair (counted with piece multiplicity) is merged at each step; ties go
    to the smallest pair ``(a, b)``. Pair counts are updated incrementally (only the pieces that hold
    the merged pair are touched) and the best pair comes from a heap with lazily dropped stale
    entries. Training stops early when no adjacent pair is left.
    """
    names = list(pieces)
    words = [list(name.encode("utf-8")) for name in names]
    freqs = [pieces[name] for name in names]
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for wi, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            counts[pair] += freq
            where[pair].add(wi)
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    while len(merges) < num_merges and heap:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg or neg == 0:
            continue  # stale: the pair's count changed after this entry was pushed
        new_id = _NUM_BYTES + 1 + len(merges)
        merges.append(pair)
        changed: set[tuple[int, int]] = set()
        for wi in sorted(where.pop(pair)):
            word, freq = words[wi], freqs[wi]
            new = _merge(word, pair, new_id)
            if len(new) == len(word):
                continue  # the index is a superset: this piece lost the pair in an earlier merge
            for p in zip(word, word[1:]):
                counts[p] -= freq
                changed.add(p)
            for p in zip(new, new[1:]):
                counts[p] += freq
                where[p].add(wi)
                changed.add(p)
            words[wi] = new
        for p in changed:
            c = counts[p]
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                del counts[p]
        counts.pop(pair, None)
    return merges, dict(zip(names, words))


class BPETokenizer:
    """Byte-level BPE. Equal tokenizers have equal merge lists (and so encode identically)."""

    def __init__(self, merges: Sequence[tuple[int, int]]):
        """Builds a tokenizer from its merges: ``merges[i] = (a, b)`` makes token ``257 + i``."""
        merges = [(int(a), int(b)) for a, b in merges]
        vocab = [bytes([i]) for i in range(_NUM_BYTES)] + [EOS_TOKEN.encode("utf-8")]
        for i, (a, b) in enumerate(merges):
            new_id = len(vocab)
            if not (0 <= a < new_id and 0 <= b < new_id) or _NUM_BYTES in (a, b):
                raise ValueError(
                    f"merges[{i}] = ({a}, {b}) must combine earlier non-eos tokens: "
                    f"ids in [0, {new_id}) except {_NUM_BYTES}"
                )
            vocab.append(vocab[a] + vocab[b])
        self._merges = merges
        self._ranks = {pair: i for i, pair in enumerate(merges)}
        self._vocab = vocab
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learns ``vocab_size - 257`` merges from ``texts`` (fewer if the texts run out of pairs).

        Args:
            texts: training texts (e.g. documents); merges never cross text or piece boundaries.
            vocab_size: total vocabulary: 256 bytes + eos + merges; at least 257.

        Returns:
            The tokenizer; the same for the same texts and vocab_size.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < _NUM_BYTES + 1:
            raise ValueError(f"vocab_size must be an int >= {_NUM_BYTES + 1} (256 bytes + eos), got {vocab_size!r}")
        counts: collections.Counter[str] = collections.Counter()
        for text in texts:
            counts.update(_pieces(text))
        merges, piece_ids = _learn_merges(counts, vocab_size - _NUM_BYTES - 1)
        tok = cls(merges)
        tok._cache.update(piece_ids)  # the training pieces are already tokenised
        return tok

    @property
    def merges(self) -> list[tuple[int, int]]:
        return list(self._merges)

    @property
    def eos_id(self) -> int:
        return _NUM_BYTES

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 + 1 + number of merges."""
        return len(self._vocab)

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            ids = list(piece.encode("utf-8"))
            ranks = self._ranks
            while len(ids) > 1:
                # The earliest-learned merge present is applied first, as in training.
                best = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, len(ranks)))
                rank = ranks.get(best)
                if rank is None:
                    break
                ids = _merge(ids, best, _NUM_BYTES + 1 + rank)
            self._cache[piece] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no eos added)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects text: str, got {type(text).__name__}")
        out: list[int] = []
        for piece in _pieces(text):
            out.extend(self._encode_piece(piece))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD, eos becomes ``<|endoftext|>``."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= len(self._vocab)):
            bad = next(i for i in ids if not 0 <= i < len(self._vocab))
            raise ValueError(f"decode: token id {bad} is out of range: ids must be in [0, {len(self._vocab)})")
        data = b"".join([self._vocab[i] for i in ids])
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for."""
        if not 0 <= token_id < len(self._vocab):
            raise ValueError(f"token_bytes: token id {token_id} is out of range: ids in [0, {len(self._vocab)})")
        return self._vocab[token_id]

    def to_json(self) -> dict:
        return {"format": _FORMAT, "version": _VERSION, "pattern": _PATTERN, "eos": EOS_TOKEN, "merges": self._merges}

    def save(self, path: str | os.PathLike) -> None:
        """Writes the tokenizer as JSON."""
        resolve(path).write_text(json.dumps(self.to_json()), encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        """Reads a tokenizer written by :meth:`save`."""
        data = json.loads(resolve(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ValueError(f"{path}: not a {_FORMAT} version {_VERSION} tokenizer file")
        if data.get("pattern") != _PATTERN or data.get("eos") != EOS_TOKEN:
            raise ValueError(f"{path}: pre-tokenisation pattern or eos token differ from this version's")
        merges = data.get("merges")
        if not isinstance(merges, list) or not all(isinstance(m, list) and len(m) == 2 for m in merges):
            raise ValueError(f"{path}: 'merges' must be a list of [a, b] id pairs")
        return cls([tuple(m) for m in merges])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BPETokenizer):
            return NotImplemented
        return self._merges == other._merges

    __hash__ = None  # mutable cache inside; equality is by content

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"
