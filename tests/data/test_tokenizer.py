"""Byte-level BPE: exact round trips, training equal to a from-scratch reference, compression, save/load."""

import collections
import json
import random

import numpy as np
import pytest

from jaxmoe.data import BPETokenizer, python_stdlib_documents, split_documents
from jaxmoe.data.tokenizer import _pieces


@pytest.fixture(scope="module")
def splits():
    return split_documents(python_stdlib_documents(300_000), 0.1)


@pytest.fixture(scope="module")
def tok(splits):
    train, _ = splits
    return BPETokenizer.train([d.text for d in train], 512)


def _ref_merge(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if tuple(ids[i : i + 2]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _ref_train(texts, vocab_size):
    """BPE from scratch: recount every pair each step, merge the most frequent (ties: smallest pair)."""
    counts = collections.Counter(p for t in texts for p in _pieces(t))
    words = {piece: list(piece.encode("utf-8")) for piece in counts}
    merges = []
    while len(merges) < vocab_size - 257:
        pairs = collections.Counter()
        for piece, ids in words.items():
            for pair in zip(ids, ids[1:]):
                pairs[pair] += counts[piece]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = {piece: _ref_merge(ids, best, 256 + len(merges)) for piece, ids in words.items()}
    return merges


def _ref_encode(merges, text):
    """Apply every merge, in learned order, to each piece's bytes."""
    out = []
    for piece in _pieces(text):
        ids = list(piece.encode("utf-8"))
        for rank, pair in enumerate(merges):
            ids = _ref_merge(ids, pair, 257 + rank)
        out.extend(ids)
    return out


def test_training_matches_from_scratch_reference(splits):
    train, _ = splits
    texts = [d.text for d in train[:6]] + ["aaaaaaa bbbbbb aaa", "====  ====\n\n\n", "ééé 日本日本 x1 x22 x333"]
    tok = BPETokenizer.train(texts, 420)
    assert tok.merges == _ref_train(texts, 420)
    assert tok.vocab_size == 420 and tok.eos_id == 256


def test_encode_matches_reference_and_uncached_tokenizer(tok, splits):
    train, heldout = splits
    for doc in heldout[:3] + train[:2]:
        assert tok.encode(doc.text) == _ref_encode(tok.merges, doc.text)
    # The trained tokenizer pre-fills its cache with the training pieces; a fresh one computes them.
    fresh = BPETokenizer(tok.merges)
    for doc in train[:10]:
        assert tok.encode(doc.text) == fresh.encode(doc.text)


def test_training_is_deterministic_and_order_free(tok, splits):
    train, _ = splits
    texts = [d.text for d in train]
    assert BPETokenizer.train(texts, 512) == tok
    assert BPETokenizer.train(texts[::-1], 512) == tok
    assert BPETokenizer.train(texts, 511) != tok


@pytest.mark.parametrize(
    "text",
    [
        "",
        "def f(x):\n    return x + 1  # comment\n",
        "   leading and trailing   \n\n\t\r\n",
        "naïve café, Straße, Ελληνικά, русский, 日本語, 한국어, العربية, हिन्दी",
        "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷 combining e\u0301 a\u0308",
        "\u3000ideographic space\xa0nbsp \u2028line sep ٣٤٥ digits ½",
        "<|endoftext|> is plain text here",
        "x" * 1000,
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.eos_id not in ids
    assert tok.decode(ids) == text


def test_round_trip_random_text(tok):
    rng = random.Random(0)
    ranges = [(0x20, 0x7E), (0x0, 0x20), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F6FF)]
    for _ in range(200):
        chars = []
        for _ in range(rng.randrange(1, 60)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text


def test_random_ids_decode_and_round_trip(tok):
    rng = np.random.default_rng(0)
    for n in (1, 7, 64, 300):
        ids = rng.integers(0, tok.vocab_size, size=n)
        text = tok.decode(ids)
        assert isinstance(text, str)
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xC3]) == "\ufffd"  # a lone UTF-8 lead byte
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])


def test_merges_compress_heldout_code(tok, splits):
    _, heldout = splits
    text = "\n".join(d.text for d in heldout)
    ratio = len(tok.encode(text)) / len(text.encode("utf-8"))
    assert ratio < 0.6, ratio
    assert tok.vocab_size == 512 and len(tok.merges) == 512 - 257


def test_token_bytes_are_concatenations(tok):
    for i, (a, b) in enumerate(tok.merges):
        assert tok.token_bytes(257 + i) == tok.token_bytes(a) + tok.token_bytes(b)
    assert tok.token_bytes(65) == b"A"


def test_save_load(tok, tmp_path, splits):
    path = tmp_path / "tok.json"
    tok.save(path)
    loaded = BPETokenizer.load(path)
    assert loaded == tok and loaded.vocab_size == tok.vocab_size and loaded.eos_id == tok.eos_id
    text = splits[1][0].text
    assert loaded.encode(text) == tok.encode(text)
    data = json.loads(path.read_text())
    data["merges"] = "nonsense"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="merges"):
        BPETokenizer.load(path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a jaxmoe-byte-bpe"):
        BPETokenizer.load(path)


def test_bad_vocab_size_and_merges():
    for bad in (256, 0, -1, 512.0, "512", True):
        with pytest.raises(ValueError, match="vocab_size"):
            BPETokenizer.train(["abc"], bad)
    assert BPETokenizer.train(["abc"], 257).vocab_size == 257
    # Texts that run out of pairs stop early: "ab" has one pair.
    assert BPETokenizer.train(["ab"], 1000).vocab_size == 258
    with pytest.raises(ValueError, match="merges"):
        BPETokenizer([(1, 300)])
    with pytest.raises(ValueError, match="merges"):
        BPETokenizer([(256, 1)])
