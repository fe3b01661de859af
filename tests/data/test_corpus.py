"""The corpus: Python stdlib sources, read deterministically, split stably by name hash."""

import pathlib
import sys
import sysconfig
import zlib

import pytest

from jaxmoe.data import CORPUS_SOURCE, Document, python_stdlib_documents, split_documents

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])


def test_documents_are_the_stdlib_files_in_name_order():
    docs = python_stdlib_documents(300_000)
    assert docs == python_stdlib_documents(300_000)
    names = [d.name for d in docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert sum(len(d.text.encode("utf-8")) for d in docs) <= 300_000
    assert len(docs) > 10
    for doc in docs:
        assert doc.name.endswith(".py") and not doc.name.startswith("/") and "\\" not in doc.name
        assert "site-packages" not in doc.name.split("/")
        assert doc.text == (STDLIB / doc.name).read_text(encoding="utf-8")
        assert doc.text.strip()
    # A larger cap extends the list: whole documents, the smaller list a prefix of the larger.
    more = python_stdlib_documents(600_000)
    assert more[: len(docs)] == docs and len(more) > len(docs)
    # The cap stops just before the first document that would not fit.
    total = sum(len(d.text.encode("utf-8")) for d in docs)
    assert total + len(more[len(docs)].text.encode("utf-8")) > 300_000


def test_all_documents_skip_third_party_and_non_utf8_files():
    docs = python_stdlib_documents()
    names = {d.name for d in docs}
    # Independent listing: every stdlib .py file outside site-packages that decodes as UTF-8 and is not blank.
    expected, not_utf8 = set(), set()
    for path in STDLIB.rglob("*.py"):
        rel = path.relative_to(STDLIB)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            not_utf8.add(rel.as_posix())
            continue
        if text.strip():
            expected.add(rel.as_posix())
    assert names == expected
    assert not names & not_utf8
    assert sum(len(d.text) for d in docs) > 4_000_000  # enough text for the 4 MB default


def test_bad_max_bytes():
    for bad in (0, -5, 1.5, True, "100"):
        with pytest.raises(ValueError, match="max_bytes"):
            python_stdlib_documents(bad)


def test_split_by_name_hash_is_deterministic_and_stable():
    docs = python_stdlib_documents(600_000)
    train, heldout = split_documents(docs, 0.2)
    assert (train, heldout) == split_documents(docs, 0.2)
    assert {d.name for d in train}.isdisjoint(d.name for d in heldout)
    assert sorted(train + heldout, key=lambda d: d.name) == docs
    # The rule, computed independently.
    assert [d.name for d in heldout] == [d.name for d in docs if zlib.crc32(d.name.encode()) < 0.2 * 2**32]
    # Adding documents moves none of the old ones.
    extra = [Document(name=f"zz_new_{i}.py", text="x = 1\n") for i in range(50)]
    train2, heldout2 = split_documents(docs + extra, 0.2)
    assert [d for d in train2 if d in docs] == train
    assert [d for d in heldout2 if d in docs] == heldout
    # A larger fraction only adds held-out documents.
    _, heldout_more = split_documents(docs, 0.5)
    assert set(heldout) <= set(heldout_more)


def test_split_bad_fraction_and_empty_split():
    docs = python_stdlib_documents(300_000)
    for bad in (0, 0.0, 1, 1.0, -0.1, 1.5, "0.1", None):
        with pytest.raises(ValueError, match="heldout_fraction"):
            split_documents(docs, bad)
    with pytest.raises(ValueError, match="held-out split empty"):
        split_documents(docs[:1], 1e-9)
    with pytest.raises(ValueError, match="train split empty"):
        split_documents(docs[:1], 1 - 1e-9)


def test_source_and_licence_stated():
    version = ".".join(map(str, sys.version_info[:3]))
    assert f"Python {version} standard library" in CORPUS_SOURCE
    assert "Python Software Foundation" in CORPUS_SOURCE
    assert "PSF License Agreement version 2" in CORPUS_SOURCE
    licence = STDLIB / "LICENSE.txt"
    if licence.is_file():
        assert str(licence) in CORPUS_SOURCE
        assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence.read_text(encoding="utf-8")
    else:
        assert "https://docs.python.org/3/license.html" in CORPUS_SOURCE
