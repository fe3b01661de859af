"""Host-side bookkeeping of the pools: free lists, reference counts, page tables.

Nothing here touches device memory: the allocator hands out ids and records which ids were
freed, and the engine zeroes those pages and slots on device (:func:`jaxmoe.inference.cache.maintain`)
before any of them is handed out again, so no request can read another's data.

A page may be held by several owners at once (a running sequence and the prefix entries that
share its full pages); it returns to the free list when the last one lets go.
"""

from __future__ import annotations

import numpy as np

from jaxmoe.inference.cache import NULL_PAGE


class OutOfPages(RuntimeError):
    """The pool has fewer free pages (or slots) than asked for; the caller evicts or preempts."""


class PagePool:
    """Pages ``1 .. num_pages - 1`` (page 0 is the null page), with reference counts."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.refs = np.zeros((num_pages,), np.int32)
        # Lowest ids first out: a stack whose top is the end of the list.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._to_zero: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{n} pages asked, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refs[pages] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more owner of each of ``pages``."""
        if pages and np.any(self.refs[pages] <= 0):
            raise ValueError(f"sharing pages that are not allocated: {pages}")
        np.add.at(self.refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """One owner fewer; pages nobody holds go back to the free list, to be zeroed first."""
        for p in pages:
            if self.refs[p] <= 0:
                raise ValueError(f"page {p} released more often than held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._to_zero.append(p)
                self._free.append(p)

    def take_zeroing(self) -> list[int]:
        """Pages freed since the last call: the engine zeroes them before the next step."""
        out, self._to_zero = self._to_zero, []
        return out


class SlotPool:
    """KDA slots ``0 .. num_slots - 1``, each with one owner."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._to_zero: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPages("no free KDA slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} released twice")
        self._free.append(slot)
        self._to_zero.append(slot)

    def take_zeroing(self) -> list[int]:
        out, self._to_zero = self._to_zero, []
        return out


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold positions ``0 .. num_tokens - 1``."""
    return -(-num_tokens // page_size)
