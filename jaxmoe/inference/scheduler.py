"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step has a token budget. Running sequences that are decoding take one token each first;
then sequences part-way through their prompt take a chunk (at most ``chunk_size`` tokens); then
waiting requests are admitted, in arrival order, while the budget, the running-sequence limit,
the KDA slots and the free pages (enough for the whole prompt) allow. A sequence's pages are
reserved as its tokens need them. When the pool runs dry, least recently used prefix entries
are evicted first; then the youngest running sequence is preempted: its pages and slot go back
and it waits at the head of the queue to be recomputed from its prompt and the tokens it has
produced (its sampling keys depend only on the token index, so its output does not change).

Everything here is host-side bookkeeping; :class:`jaxmoe.inference.engine.Engine` runs the step.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from jaxmoe.inference.allocator import PagePool, SlotPool, pages_for
from jaxmoe.inference.constraint import Constraint
from jaxmoe.inference.prefix import PrefixCache, PrefixEntry
from jaxmoe.inference.sampler import SamplingParams


@dataclasses.dataclass(frozen=True, eq=False)
class Images:
    """A request's images, preprocessed (:func:`jaxmoe.vision.preprocess.preprocess`).

    Attributes:
      pixel_values: ``[P, 3, patch, patch]`` float32 patches of the images in order.
      grid_thw: ``[I, 3]`` int patch grid of each image; the prompt holds one ``image_token_id``
        placeholder per merged patch, the images' in order.
    """

    pixel_values: np.ndarray
    grid_thw: np.ndarray

    def digests(self) -> list[bytes]:
        """A content digest per image (its grid and patches): the prefix key of its tokens."""
        out, start = [], 0
        for t, h, w in np.asarray(self.grid_thw).tolist():
            n = t * h * w
            pixels = np.ascontiguousarray(self.pixel_values[start : start + n], np.float32)
            out.append(hashlib.sha256(np.asarray([t, h, w], np.int64).tobytes() + pixels.tobytes()).digest())
            start += n
        return out


@dataclasses.dataclass(frozen=True)
class Request:
    """What a caller asks for.

    Attributes:
      prompt_ids: the prompt's token ids (non-empty).
      max_tokens: most new tokens to produce.
      sampling: temperature, top-p, top-k, seed.
      stop: strings that end the output (needs the engine's detokenizer).
      ignore_eos: keep going past the eos token.
      tenant: prefix reuse scope (the API key's identity); None: no prefix reuse.
      stop_ids: more token ids that end the output (a chat format's end of turn); kept in the output.
      constraint: restricts which tokens may be sampled (see :mod:`jaxmoe.inference.constraint`).
      priority: lower runs its prompt chunks first (a latency tier ahead of a deep one).
      min_tokens: the first this many new tokens are never eos, a stop id or a stop string's end
        (HF ``min_new_tokens``, vLLM ``min_tokens``), unless the constraint allows nothing else.
      images: the images of the prompt's placeholders (a model with a vision tower), or None.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    tenant: str | None = None
    stop_ids: tuple[int, ...] = ()
    constraint: Constraint | None = dataclasses.field(default=None, compare=False)
    priority: int = 0
    min_tokens: int = 0
    images: Images | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class Sequence:
    """A request in the engine: its tokens so far and what it holds in the pools."""

    id: int
    request: Request
    tokens: list[int]
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose latents/state are in the pools
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    cached_tokens: int = 0  # prompt tokens taken from a prefix entry at the last admission
    admitted_tokens: int = 0  # len(tokens) at the last admission: positions below it are prefill
    prompt_snapshot: bool = False  # a prefix entry at the prompt's end was taken
    finish_reason: str | None = None
    text: str | None = None
    # With images: the merged image features [M, D] (computed once, at submission), the feature row
    # of each prompt position ([prompt] int32, -1: a text token) and its prefix key ([prompt] int64,
    # negative at image tokens: derived from the image's content, so that two requests with the same
    # placeholder ids but other images never share a prefix).
    features: np.ndarray | None = None
    feature_rows: np.ndarray | None = None
    image_keys: np.ndarray | None = None

    def key(self, n: int | None = None) -> np.ndarray:
        """The prefix key ``[n]`` int64 of the first ``n`` tokens (all by default)."""
        key = np.asarray(self.tokens[: len(self.tokens) if n is None else n], np.int64)
        if self.image_keys is not None:
            m = min(len(key), len(self.image_keys))
            key[:m] = np.where(self.image_keys[:m] < 0, self.image_keys[:m], key[:m])
        return key

    def image_rows(self, start: int, n: int) -> np.ndarray | None:
        """Feature rows ``[n]`` of positions ``start .. start + n - 1`` (-1: text), or None without images."""
        if self.feature_rows is None or start >= len(self.feature_rows):
            return None
        rows = np.full((n,), -1, np.int32)
        part = self.feature_rows[start : start + n]
        rows[: len(part)] = part
        return rows if (rows >= 0).any() else None

    @property
    def pending(self) -> int:
        """Tokens not yet computed; 1 means the sequence is decoding."""
        return len(self.tokens) - self.computed


@dataclasses.dataclass
class Plan:
    """One step: rows ``(sequence, new tokens)`` and the pool maintenance to do before it."""

    rows: list[tuple[Sequence, int]]
    zero_pages: list[int]
    zero_slots: list[int]
    copy_pages: list[tuple[int, int]]
    copy_slots: list[tuple[int, int]]


class Scheduler:
    """Waiting and running sets, page and slot pools, prefix entries."""

    def __init__(
        self,
        *,
        num_pages: int,
        num_slots: int,
        page_size: int,
        max_seqs: int,
        step_tokens: int,
        chunk_size: int,
        prefix_cache: bool = True,
    ):
        if step_tokens < max_seqs:
            raise ValueError(f"step_tokens ({step_tokens}) must be >= max_seqs ({max_seqs}): every decode needs one")
        if num_slots < max_seqs:
            raise ValueError(f"num_slots ({num_slots}) must be >= max_seqs ({max_seqs})")
        self.pages = PagePool(num_pages)
        self.slots = SlotPool(num_slots)
        self.page_size, self.max_seqs = page_size, max_seqs
        self.step_tokens, self.chunk_size = step_tokens, chunk_size
        self.prefix = PrefixCache() if prefix_cache else None
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens taken from prefix entries, over all admissions
        self._copies: tuple[list, list] = ([], [])
        self._pending_snapshots: list[tuple[int, int]] = []  # (sequence slot, snapshot slot) to copy next step

    # ------------------------------------------------------------------------------------
    # Pools

    def _evict_one(self) -> bool:
        """Frees the least recently used prefix entry not used in this step; False if none."""
        entry = self.prefix.pop_lru(self.steps) if self.prefix is not None else None
        if entry is None:
            return False
        self.pages.release(entry.pages)
        self.slots.release(entry.slot)
        return True

    def _release(self, seq: Sequence) -> None:
        self.pages.release(seq.pages)
        if seq.slot is not None:
            self.slots.release(seq.slot)
        seq.pages, seq.slot = [], None

    def preempt(self, seq: Sequence) -> None:
        """Back to the head of the queue; everything it computed is recomputed on readmission."""
        self.running.remove(seq)
        self._release(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _reserve(self, seq: Sequence, upto: int, rows: list) -> bool:
        """Pages for positions ``0 .. upto - 1``; False when ``seq`` itself had to be preempted."""
        need = pages_for(upto, self.page_size) - len(seq.pages)
        while need > self.pages.num_free:
            if self._evict_one():
                continue
            victim = self.running[-1]
            self.preempt(victim)
            rows[:] = [r for r in rows if r[0] is not victim]
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.pages.allocate(need)
        return True

    # ------------------------------------------------------------------------------------
    # Admission

    def _admit(self, seq: Sequence) -> bool:
        """Moves the head of the queue to running if a slot and pages for its prompt are there."""
        entry = None
        if self.prefix is not None and seq.request.tenant is not None:
            entry = self.prefix.lookup(seq.request.tenant, seq.key(), self.steps)
        n = len(entry.tokens) if entry else 0
        shared = n // self.page_size
        need = pages_for(len(seq.tokens), self.page_size) - shared
        while (self.pages.num_free < need or self.slots.num_free < 1) and self._evict_one():
            pass
        if self.pages.num_free < need or self.slots.num_free < 1:
            return False
        self.waiting.popleft()
        seq.slot = self.slots.allocate()
        seq.computed = seq.cached_tokens = n
        self.cached_tokens += n
        seq.admitted_tokens = len(seq.tokens)
        if entry is not None:
            self.pages.share(entry.pages[:shared])
            seq.pages = entry.pages[:shared]
            if n % self.page_size:  # the boundary page: this sequence writes its rest, so a copy
                page = self.pages.allocate(1)[0]
                self._copies[0].append((entry.pages[shared], page))
                seq.pages = seq.pages + [page]
            self._copies[1].append((entry.slot, seq.slot))
        self.running.append(seq)
        return True

    def submit(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ------------------------------------------------------------------------------------
    # A step

    def schedule(self) -> Plan:
        """The next step's rows; admits, evicts and preempts as needed."""
        self.steps += 1
        self._copies = ([], list(self._pending_snapshots))
        self._pending_snapshots = []
        rows: list[tuple[Sequence, int]] = []
        budget = self.step_tokens
        decoding = [s for s in self.running if s.pending == 1]
        prefilling = sorted((s for s in self.running if s.pending > 1), key=lambda s: s.request.priority)
        for seq in decoding + prefilling:
            if seq not in self.running or budget <= 0:
                continue
            n = min(seq.pending, self.chunk_size, budget)
            if self._reserve(seq, seq.computed + n, rows):
                rows.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            n = min(seq.pending, self.chunk_size, budget)
            if self._reserve(seq, seq.computed + n, rows):
                rows.append((seq, n))
                budget -= n
        copy_pages, copy_slots = self._copies
        written_pages = {d for _, d in copy_pages}
        written_slots = {d for _, d in copy_slots}
        return Plan(
            rows=rows,
            zero_pages=[p for p in self.pages.take_zeroing() if p not in written_pages],
            zero_slots=[z for z in self.slots.take_zeroing() if z not in written_slots],
            copy_pages=copy_pages,
            copy_slots=copy_slots,
        )

    def snapshot_prompt(self, seq: Sequence) -> None:
        """A prefix entry at the end of ``seq``'s prompt, taken before its next step changes its state.

        An agent's next turn starts with this turn's prompt exactly (whatever the model's tokens
        re-encode to), so this entry is the one the next turn finds. The entry shares the prompt's
        pages and gets a copy of the KDA slot (made by the next step's maintenance, which runs
        before the model; copies read before freed slots are zeroed, so a preemption in between
        is harmless). Skipped when no slot is free.
        """
        if self.prefix is None or seq.request.tenant is None or seq.prompt_snapshot or seq.slot is None:
            return
        seq.prompt_snapshot = True
        if self.slots.num_free < 1 and not self._evict_one():
            return
        n = len(seq.request.prompt_ids)
        pages = seq.pages[: pages_for(n, self.page_size)]
        self.pages.share(pages)
        slot = self.slots.allocate()
        self._pending_snapshots.append((seq.slot, slot))
        tokens = seq.key(n)
        self.prefix.add(PrefixEntry(seq.request.tenant, tokens, list(pages), slot, self.steps))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a running or waiting sequence; a tenant's sequence leaves a prefix entry."""
        seq.finish_reason = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        self.running.remove(seq)
        keep = pages_for(seq.computed, self.page_size)
        extra, seq.pages = seq.pages[keep:], seq.pages[:keep]
        self.pages.release(extra)
        if (
            self.prefix is not None
            and seq.request.tenant is not None
            and reason != "cancelled"
            and seq.computed > 0
            and seq.slot is not None
        ):
            tokens = seq.key(seq.computed)
            self.prefix.add(PrefixEntry(seq.request.tenant, tokens, seq.pages, seq.slot, self.steps))
            seq.pages, seq.slot = [], None
        else:
            self._release(seq)
