"""Token streams (cached), packed resumable batches, and held-out evaluation batches."""

import json
import os

import numpy as np
import pytest

from jaxmoe.chat.tokenizer import Tokenizer
from jaxmoe.data import (
    PackedBatches,
    build_token_data,
    heldout_batches,
    python_stdlib_documents,
    split_documents,
)

ARGS = dict(vocab_size=512, max_bytes=300_000, heldout_fraction=0.1)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="module")
def data(cache_dir):
    return build_token_data(**ARGS, cache_dir=cache_dir)


def test_streams_are_the_split_documents_joined_by_eos(data):
    train_docs, heldout_docs = split_documents(python_stdlib_documents(ARGS["max_bytes"]), ARGS["heldout_fraction"])
    for stream, docs in ((data.train, train_docs), (data.heldout, heldout_docs)):
        assert stream.dtype == np.int32 and stream.ndim == 1
        assert stream.min() >= 0 and stream.max() < data.tokenizer.vocab_size
        assert int((stream == data.tokenizer.eos_id).sum()) == len(docs) - 1
        pieces = np.split(stream, np.flatnonzero(stream == data.tokenizer.eos_id))
        texts = [data.tokenizer.decode(p[1:] if i else p) for i, p in enumerate(pieces)]
        assert texts == [d.text for d in docs]
    # The held-out stream holds held-out documents only, and the tokenizer saw only train documents.
    assert {d.name for d in train_docs}.isdisjoint(d.name for d in heldout_docs)
    assert data.tokenizer == Tokenizer.train([d.text for d in train_docs], ARGS["vocab_size"])
    assert "PSF License Agreement version 2" in data.source and f"{len(heldout_docs)} held out" in data.source


def test_cache_is_reused_without_retraining(data, cache_dir, monkeypatch):
    (entry,) = [p for p in cache_dir.iterdir()]  # one complete entry, no temporary leftovers
    assert sorted(os.listdir(entry)) == [
        "heldout.npy",
        "meta.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "train.npy",
    ]
    mtimes = {name: os.stat(entry / name).st_mtime_ns for name in os.listdir(entry)}

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was retrained")

    monkeypatch.setattr(Tokenizer, "train", classmethod(no_training))
    again = build_token_data(**ARGS, cache_dir=cache_dir)
    np.testing.assert_array_equal(again.train, data.train)
    np.testing.assert_array_equal(again.heldout, data.heldout)
    assert again.tokenizer == data.tokenizer and again.source == data.source
    assert {name: os.stat(entry / name).st_mtime_ns for name in os.listdir(entry)} == mtimes
    # Other parameters are another entry: it has to train.
    with pytest.raises(AssertionError, match="retrained"):
        build_token_data(**{**ARGS, "vocab_size": 300}, cache_dir=cache_dir)
    with pytest.raises(AssertionError, match="retrained"):
        build_token_data(**{**ARGS, "heldout_fraction": 0.2}, cache_dir=cache_dir)
    assert [p for p in cache_dir.iterdir()] == [entry]


def test_bad_build_arguments(tmp_path):
    for bad in (100, 266):
        with pytest.raises(ValueError, match="vocab_size must be an int >= 267"):
            build_token_data(**{**ARGS, "vocab_size": bad}, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="heldout_fraction"):
        build_token_data(**{**ARGS, "heldout_fraction": 1.0}, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="max_bytes"):
        build_token_data(**{**ARGS, "max_bytes": 0}, cache_dir=tmp_path)


def _window_ids(batch, seq_len):
    """Window index of each row of a batch drawn from the stream np.arange(n)."""
    starts = batch[:, 0]
    assert np.all(starts % seq_len == 0)
    np.testing.assert_array_equal(batch, starts[:, None] + np.arange(seq_len + 1))
    return (starts // seq_len).tolist()


def test_batches_shapes_shift_and_epochs():
    seq_len, batch_size, n = 7, 3, 7 * 23 + 5  # 23 windows: batches straddle epoch ends
    it = PackedBatches(np.arange(n), seq_len=seq_len, batch_size=batch_size, seed=11)
    assert it.num_windows == 23
    order = []
    for _ in range(31):  # 93 windows: four full epochs and one started
        batch = next(it)
        assert batch.shape == (batch_size, seq_len + 1) and batch.dtype == np.int32
        inputs, targets = batch[:, :-1], batch[:, 1:]
        np.testing.assert_array_equal(targets, inputs + 1)  # targets are the next tokens
        order += _window_ids(batch, seq_len)
    for epoch in range(4):
        visited = order[23 * epoch : 23 * (epoch + 1)]
        assert sorted(visited) == list(range(23))  # each window once per epoch
        np.testing.assert_array_equal(visited, np.random.default_rng([11, epoch]).permutation(23))
    assert order[:23] != order[23:46]
    # Every token after the first is a target exactly once per epoch (stride seq_len, one shared token).
    targets = np.concatenate([np.arange(w * seq_len + 1, (w + 1) * seq_len + 1) for w in order[:23]])
    np.testing.assert_array_equal(np.sort(targets), np.arange(1, 23 * seq_len + 1))
    assert it.state() == {"epoch": 4, "position": 1, "seed": 11, "seq_len": 7, "batch_size": 3, "num_tokens": n}


def test_seeds_give_different_orders_and_same_seed_same_batches():
    tokens = np.arange(500)
    a = PackedBatches(tokens, seq_len=5, batch_size=4, seed=0)
    b = PackedBatches(tokens, seq_len=5, batch_size=4, seed=0)
    c = PackedBatches(tokens, seq_len=5, batch_size=4, seed=1)
    first = [next(a) for _ in range(10)]
    assert all(np.array_equal(x, next(b)) for x in first)
    assert not all(np.array_equal(x, next(c)) for x in first)


@pytest.mark.parametrize("stop", [0, 1, 4, 7, 8, 12, 15, 16])
def test_restore_reproduces_the_uninterrupted_stream(stop):
    # 23 windows, batch 3: batch 7 straddles epochs 0/1, batch 15 straddles 1/2, and after
    # batch 23 (3 * 23 = 69 windows) an epoch ends exactly on a batch boundary.
    tokens = np.random.default_rng(5).integers(0, 1000, size=7 * 23 + 3)
    make = lambda seed=3: PackedBatches(tokens, seq_len=7, batch_size=3, seed=seed)
    reference = make()
    expected = [next(reference) for _ in range(30)]
    it = make()
    for _ in range(stop):
        next(it)
    state = json.loads(json.dumps(it.state()))
    resumed = make(seed=99)  # the state's seed is adopted
    resumed.restore(state)
    for k in range(stop, 30):
        np.testing.assert_array_equal(next(resumed), expected[k])
    # The interrupted iterator itself carries on unchanged.
    np.testing.assert_array_equal(next(it), expected[stop])


def test_restore_at_exact_epoch_boundary():
    tokens = np.arange(4 * 12 + 1)  # 12 windows, batch 4: epochs end on batch boundaries
    it = PackedBatches(tokens, seq_len=4, batch_size=4, seed=2)
    epoch0 = [next(it) for _ in range(3)]
    state = it.state()
    assert state["epoch"] == 1 and state["position"] == 0
    rest = [next(it) for _ in range(4)]
    other = PackedBatches(tokens, seq_len=4, batch_size=4, seed=2)
    other.restore(state)
    for batch in rest:
        np.testing.assert_array_equal(next(other), batch)
    assert not np.array_equal(np.concatenate(rest[:3]), np.concatenate(epoch0))  # epoch 1: a new permutation


def test_restore_mismatch_errors():
    tokens = np.arange(200)
    it = PackedBatches(tokens, seq_len=5, batch_size=2, seed=0)
    good = it.state()
    for field, value in (("seq_len", 6), ("batch_size", 3), ("num_tokens", 199)):
        with pytest.raises(ValueError, match=field):
            it.restore({**good, field: value})
    with pytest.raises(ValueError, match="num_tokens"):
        PackedBatches(tokens[:-1], seq_len=5, batch_size=2, seed=0).restore(good)
    with pytest.raises(ValueError, match="'epoch'"):
        it.restore({k: v for k, v in good.items() if k != "epoch"})
    with pytest.raises(ValueError, match="position"):
        it.restore({**good, "position": it.num_windows})
    with pytest.raises(ValueError, match="position"):
        it.restore({**good, "position": "3"})
    with pytest.raises(ValueError, match="epoch"):
        it.restore({**good, "epoch": -1})
    with pytest.raises(ValueError, match="seed"):
        it.restore({**good, "seed": -1})


def test_too_few_tokens_and_bad_arguments():
    # batch 4 of seq_len 10 needs 4 windows: 4 * 10 + 1 = 41 tokens.
    PackedBatches(np.arange(41), seq_len=10, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="at least 41 are needed"):
        PackedBatches(np.arange(40), seq_len=10, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="at least 41 are needed"):
        PackedBatches(np.arange(0), seq_len=10, batch_size=4, seed=0)
    for kwargs, field in (
        (dict(seq_len=0, batch_size=1, seed=0), "seq_len"),
        (dict(seq_len=4, batch_size=0, seed=0), "batch_size"),
        (dict(seq_len=4, batch_size=1, seed=-1), "seed"),
        (dict(seq_len=4.0, batch_size=1, seed=0), "seq_len"),
    ):
        with pytest.raises(ValueError, match=field):
            PackedBatches(np.arange(100), **kwargs)
    with pytest.raises(ValueError, match="1-D integer"):
        PackedBatches(np.zeros((10, 10), np.int32), seq_len=4, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="1-D integer"):
        PackedBatches(np.zeros(100, np.float32), seq_len=4, batch_size=1, seed=0)


def test_heldout_batches_fixed_and_in_order():
    tokens = np.arange(3 * 2 * 6 + 1)
    batches = heldout_batches(tokens, seq_len=6, batch_size=2, num_batches=3)
    assert len(batches) == 3
    windows = [w for b in batches for w in _window_ids(b, 6)]
    assert windows == list(range(6))
    assert all(b.shape == (2, 7) and b.dtype == np.int32 for b in batches)
    again = heldout_batches(tokens, seq_len=6, batch_size=2, num_batches=3)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again))
    with pytest.raises(ValueError, match="at least 37 are needed"):
        heldout_batches(tokens[:-1], seq_len=6, batch_size=2, num_batches=3)
    with pytest.raises(ValueError, match="num_batches"):
        heldout_batches(tokens, seq_len=6, batch_size=2, num_batches=0)


def test_real_streams_feed_both_iterators(data):
    it = PackedBatches(data.train, seq_len=64, batch_size=8, seed=0)
    batch = next(it)
    assert batch.shape == (8, 65) and batch.dtype == np.int32
    starts = [
        int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(data.train, 65) == row, axis=1))[0])
        for row in batch[:2]
    ]
    assert all(s % 64 == 0 for s in starts)
    evals = heldout_batches(data.heldout, seq_len=64, batch_size=8, num_batches=2)
    np.testing.assert_array_equal(evals[0][0], data.heldout[:65])
    np.testing.assert_array_equal(evals[1][0], data.heldout[8 * 64 : 8 * 64 + 65])
    # Evaluation text comes from held-out documents only: decode it and find it in them.
    heldout_text = data.tokenizer.decode(data.heldout)
    train_text = data.tokenizer.decode(data.train)
    snippet = data.tokenizer.decode(evals[1][3])
    assert snippet in heldout_text and snippet not in train_text
