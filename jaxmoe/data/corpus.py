"""The training corpus: the Python standard library's own sources, which ship with every interpreter.

It is real text (code, docstrings, comments), available offline on any machine that runs jaxmoe,
and under a permissive licence. Documents are the ``*.py`` files under the interpreter's stdlib
directory, named by their path relative to it; ``site-packages``/``dist-packages`` (third-party
code), ``__pycache__``, files that are not valid UTF-8 and whitespace-only files are skipped.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import sysconfig
import zlib
from collections.abc import Sequence

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> pathlib.Path:
    """The directory holding this interpreter's standard library sources."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _corpus_source() -> str:
    version = ".".join(str(v) for v in sys.version_info[:3])
    root = stdlib_dir()
    licence = root / "LICENSE.txt"
    where = licence if licence.is_file() else "https://docs.python.org/3/license.html"
    return (
        f"Python {version} standard library sources (the *.py files under {root}, site-packages excluded), "
        f"(c) Python Software Foundation, PSF License Agreement version 2 (the PYTHON SOFTWARE FOUNDATION "
        f"LICENSE VERSION 2 section of {where}, which also lists the few incorporated components under "
        f"other permissive licences)."
    )


CORPUS_SOURCE: str = _corpus_source()


@dataclasses.dataclass(frozen=True)
class Document:
    """One source file: ``name`` is its path relative to the stdlib directory (posix), ``text`` its contents."""

    name: str
    text: str


def _stdlib_files(root: pathlib.Path) -> list[str]:
    """Relative posix names of the ``*.py`` files under ``root``, sorted; symlinked dirs not followed."""
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = pathlib.Path(dirpath).relative_to(root)
        names.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(names)


def python_stdlib_documents(max_bytes: int | None = None) -> list[Document]:
    """The stdlib sources as documents, sorted by name.

    Args:
        max_bytes: cap on the total UTF-8 size of the returned texts. Documents are taken whole, in
            name order, and the list stops before the first one that would exceed the cap. None: all.

    Returns:
        The documents; the same list on every call on the same interpreter.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    root = stdlib_dir()
    docs: list[Document] = []
    total = 0
    for name in _stdlib_files(root):
        raw = (root / name).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        if max_bytes is not None and total + len(raw) > max_bytes:
            break
        docs.append(Document(name=name, text=text))
        total += len(raw)
    return docs


def _heldout_score(name: str) -> float:
    """A stable number in [0, 1) per name: a document's split depends on its name alone."""
    return zlib.crc32(name.encode("utf-8")) / 2**32


def split_documents(docs: Sequence[Document], heldout_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic train / held-out split by a hash (CRC-32) of each document's name.

    A document goes to the held-out split when ``crc32(name) / 2**32 < heldout_fraction``, so adding or
    removing other files never moves it. Input order is kept within each split.

    Args:
        docs: the documents.
        heldout_fraction: the expected fraction held out, in (0, 1).

    Returns:
        ``(train, heldout)``, both non-empty.
    """
    if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, int | float):
        raise ValueError(f"heldout_fraction must be a number in (0, 1), got {heldout_fraction!r}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1) (exclusive), got {heldout_fraction}")
    train: list[Document] = []
    heldout: list[Document] = []
    for doc in docs:
        (heldout if _heldout_score(doc.name) < heldout_fraction else train).append(doc)
    for split, part in (("train", train), ("held-out", heldout)):
        if not part:
            raise ValueError(
                f"split_documents: heldout_fraction={heldout_fraction} over {len(docs)} documents leaves the "
                f"{split} split empty; use more documents (a larger max_bytes) or another heldout_fraction"
            )
    return train, heldout
