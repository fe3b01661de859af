"""Prefix reuse across an agent's turns, scoped to a tenant.

An agent re-sends its whole history each turn. When a request of a tenant finishes, its pages
(the latents and indexer keys of every token it computed) and its KDA slot (the delta-rule state
after exactly those tokens) become a prefix entry instead of being freed. A later request of the
same tenant whose prompt starts with an entry's tokens starts from there: it shares the entry's
full pages, gets a copy of the page the boundary falls in (it will write the rest of that page)
and a copy of the KDA snapshot, and computes only its new tokens.

Reusing pages without the state snapshot taken at the same boundary would feed KDA layers the
wrong state (the bug DESIGN.md section 7 warns of), so an entry always holds both, taken at the
same token. Entries of one tenant are never matched by another's request: a cross-tenant hit
would leak prompts through timing. Entries are evicted least recently used first, when the pools
need their pages or slots.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False)  # entries are compared by identity (their tokens are arrays)
class PrefixEntry:
    tenant: str
    tokens: np.ndarray  # [n] int64: the key of the tokens whose state the entry holds (Sequence.key)
    pages: list[int]  # pages holding positions 0 .. n - 1
    slot: int  # KDA snapshot after token n - 1
    last_used: int = 0


class PrefixCache:
    """The entries, by tenant; lookups are linear in a tenant's entries (a handful per agent)."""

    def __init__(self):
        self._entries: dict[str, list[PrefixEntry]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def pages(self) -> set[int]:
        """Every page some entry holds."""
        return {p for v in self._entries.values() for e in v for p in e.pages}

    def add(self, entry: PrefixEntry) -> None:
        self._entries.setdefault(entry.tenant, []).append(entry)

    def lookup(self, tenant: str, prompt: np.ndarray, now: int) -> PrefixEntry | None:
        """The longest entry of ``tenant`` that is a proper prefix of ``prompt`` (marked used at ``now``)."""
        best = None
        for e in self._entries.get(tenant, ()):
            n = len(e.tokens)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and np.array_equal(prompt[:n], e.tokens):
                best = e
        if best is not None:
            best.last_used = now
        return best

    def pop_lru(self, before: int) -> PrefixEntry | None:
        """Removes and returns the least recently used entry last used before step ``before``."""
        candidates = [e for v in self._entries.values() for e in v if e.last_used < before]
        if not candidates:
            return None
        victim = min(candidates, key=lambda e: e.last_used)
        self._entries[victim.tenant].remove(victim)
        if not self._entries[victim.tenant]:
            del self._entries[victim.tenant]
        return victim
