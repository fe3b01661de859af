"""The engine's step programs: which shapes are compiled, and compiling new ones off the engine thread.

A step's :class:`Shape` (decode rows, prefill rows and chunk, page-table width, whether rows are
masked) picks its program. The first step of a new shape compiles one (seconds on a CPU host, much
more for a large model), and a server meets new shapes all its life: a long agent's page table
grows into the next width, a burst of prompts fills more prefill rows. With ``background`` on,
:meth:`Programs.choose` runs such a step on the cheapest compiled shape that covers it (more rows,
longer chunks, a wider page table: padding rows and padding pages change no real row's result)
while a compiler thread builds the exact program; later steps of that shape use it. Without a
covering shape the step compiles on the spot, as it does with ``background`` off (the default of
the engine, and always on a mesh: there the pools take the layout XLA gives the first write's
output, and every process of a multi-process run must run the same program in the same step).

Padding is exact in arithmetic but not in floating-point rounding: a padded step's logits may
differ from the exact program's in the last bits, so greedy outputs can differ where two tokens
tie to rounding. Runs that must be bit-reproducible leave ``background`` off.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmoe.inference.cache import CacheSpec
from jaxmoe.inference.forward import Rows
from jaxmoe.inference.sampler import RowSampling

log = logging.getLogger(__name__)


class StepKey:
    """The jitted step's static argument: the model's graphdef and the pools' spec, hashed once.

    JAX hashes static arguments on every call, and hashing a model's graphdef walks its whole
    tree (~10 ms a step for the 4-layer benchmark model on a 2-core host, a third of a decode
    step). Keys are interned (:func:`step_key`), so engines of the same model share compiled
    programs and a lookup compares by identity.
    """

    __slots__ = ("graphdef", "spec", "_hash")

    def __init__(self, graphdef, spec: CacheSpec):
        self.graphdef, self.spec = graphdef, spec
        self._hash = hash((graphdef, spec))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, StepKey)
            and self._hash == other._hash
            and (self.graphdef, self.spec) == (other.graphdef, other.spec)
        )


_STEP_KEYS: dict[StepKey, StepKey] = {}


def step_key(graphdef, spec: CacheSpec) -> StepKey:
    """The interned :class:`StepKey` of ``(graphdef, spec)``."""
    key = StepKey(graphdef, spec)
    return _STEP_KEYS.setdefault(key, key)


class Shape(NamedTuple):
    """The bucketed shape of one step.

    Attributes:
      decode_rows: rows of the decode group (one new token each); 0: no decode group.
      prefill_rows: rows of the prefill group; 0: no prefill group.
      chunk: new tokens per prefill row (0 without a prefill group).
      pages: page-table width of both groups.
      masked: the sampler gets a ``[B, V]`` mask of allowed tokens.
      images: the groups carry image-token embeddings (:class:`Rows` ``embeds``).
    """

    decode_rows: int
    prefill_rows: int
    chunk: int
    pages: int
    masked: bool
    images: bool = False

    def covers(self, other: Shape) -> bool:
        """Every row of a step of shape ``other`` fits this shape's groups."""
        return (
            self.decode_rows >= other.decode_rows
            and self.prefill_rows >= other.prefill_rows
            and (other.prefill_rows == 0 or self.chunk >= other.chunk)
            and self.pages >= other.pages
            and self.masked >= other.masked
            and self.images >= other.images
        )

    def cost(self) -> int:
        """A proxy for the step's work: the tokens it computes and the pages they attend over."""
        return self.decode_rows * (1 + self.pages) + self.prefill_rows * (self.chunk + self.pages)

    def rows(self) -> int:
        return self.decode_rows + self.prefill_rows


def shape_of(groups: tuple[Rows, ...], sampling: RowSampling) -> Shape:
    """The :class:`Shape` of a step's arrays (a decode group has T = 1, a prefill group T >= 8)."""
    decode = [g for g in groups if g.tokens.shape[1] == 1]
    prefill = [g for g in groups if g.tokens.shape[1] > 1]
    return Shape(
        decode_rows=decode[0].tokens.shape[0] if decode else 0,
        prefill_rows=prefill[0].tokens.shape[0] if prefill else 0,
        chunk=prefill[0].tokens.shape[1] if prefill else 0,
        pages=groups[0].pages.shape[1],
        masked=sampling.mask is not None,
        images=groups[0].embeds is not None,
    )


def abstract_inputs(shape: Shape, vocab_size: int, d_model: int = 0) -> tuple[tuple[Rows, ...], RowSampling]:
    """``(groups, sampling)`` of ``shape`` as ``jax.ShapeDtypeStruct`` (what a program is lowered for);
    ``d_model``: the width of the image embeddings of a shape with ``images``."""

    def sds(dims, dtype=np.int32):
        return jax.ShapeDtypeStruct(dims, dtype)

    def group(B, T):
        images = (sds((B, T, d_model), np.float32), sds((B, T), np.bool_)) if shape.images else (None, None)
        return Rows(sds((B, T)), sds((B,)), sds((B,)), sds((B, shape.pages)), sds((B,)), *images)

    groups = []
    if shape.decode_rows:
        groups.append(group(shape.decode_rows, 1))
    if shape.prefill_rows:
        groups.append(group(shape.prefill_rows, shape.chunk))
    N = shape.rows()
    mask = sds((N, vocab_size), np.bool_) if shape.masked else None
    f32, u32 = np.float32, np.uint32
    sampling = RowSampling(sds((N,), f32), sds((N,), f32), sds((N,)), sds((N,), u32), sds((N,)), mask)
    return tuple(groups), sampling


class Programs:
    """The shapes an engine has compiled, and the compiler thread.

    Args:
      compile: ``Shape -> program``, the ahead-of-time compile of one shape's step (run on the
        compiler thread).
      background: compile new shapes on the compiler thread while steps run on covering shapes.
    """

    def __init__(self, compile: Callable[[Shape], Any], background: bool):
        self._compile = compile
        self.background = background
        self.known: set[Shape] = set()  # compiled by the step's jit (on the engine thread)
        self.ready: dict[Shape, Any] = {}  # compiled ahead of time (on the compiler thread)
        self.pending: set[Shape] = set()
        self.failed: set[Shape] = set()  # the compiler thread failed: the step compiles (and raises) itself
        self.padded_steps = 0  # steps run on a covering shape while their own compiled
        self._lock = threading.Lock()
        self._queue: queue.Queue[Shape] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def choose(self, want: Shape) -> Shape:
        """The shape to run a step of shape ``want`` on: ``want`` itself once it is compiled (or
        when nothing compiled covers it), else the cheapest compiled shape that covers it, and
        ``want`` is queued for the compiler thread."""
        if not self.background or want in self.known or want in self.failed:
            return want
        with self._lock:
            if want in self.ready:
                return want
            covering = [s for s in (*self.known, *self.ready) if s.covers(want)]
            if not covering:
                return want
            if want not in self.pending:
                self.pending.add(want)
                self._queue.put(want)
                self._start()
        self.padded_steps += 1
        return min(covering, key=Shape.cost)

    def count(self) -> int:
        """Programs held: compiled by the step's jit, ahead of time, or compiling now."""
        with self._lock:
            return len(self.known) + len(self.ready) + len(self.pending)

    def forget(self) -> None:
        """Drops every compiled program (the caller cleared the step's jit cache); pending ones stay."""
        with self._lock:
            self.known.clear()
            self.ready.clear()

    def program(self, shape: Shape):
        """The ahead-of-time program of ``shape``, or None (the step's jit compiles or has it)."""
        with self._lock:
            return self.ready.get(shape)

    def wait(self) -> None:
        """Blocks until the compiler thread has no shape left to compile."""
        with self._idle:
            self._idle.wait_for(lambda: not self.pending)

    def _start(self) -> None:
        if self._thread is None:
            # A daemon: a compile still running at exit must not hold the process open.
            self._thread = threading.Thread(target=self._loop, name="jaxmoe-compile", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            shape = self._queue.get()
            program = None
            try:
                program = self._compile(shape)
            except Exception:  # the step compiles it on the engine thread instead, and raises there
                log.exception("compiling the step for %s in the background failed", shape)
            with self._idle:
                if program is not None:
                    self.ready[shape] = program
                else:
                    self.failed.add(shape)
                self.pending.discard(shape)
                self._idle.notify_all()
