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

Not every shape met is worth a program. Which shapes a server meets depends on how requests
arrive between steps (a prompt admitted beside 3 decoding rows or beside 5), so most of them are
met a few times and never again, and each compile takes a core from the running steps for
seconds. A shape is compiled once it has been met ``compile_after`` times, or at once when its
cheapest cover does more than ``max_padding`` times its work (:meth:`Shape.cost`); until then it
runs on the cover. :meth:`Programs.warm` compiles covers ahead of any request (a server's start),
so that no step has to compile on the spot.

Padding is exact in arithmetic but not in floating-point rounding: a padded step's logits may
differ from the exact program's in the last bits, so greedy outputs can differ where two tokens
tie to rounding. Runs that must be bit-reproducible leave ``background`` off.
"""

from __future__ import annotations

import logging
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
    """The jitted step's static argument: the model's graphdef, the pools' spec and the step's token
    budget (the most real tokens a step holds: its FFN runs on that many, see
    :func:`jaxmoe.inference.forward.forward`; None: on every padded token), hashed once.

    JAX hashes static arguments on every call, and hashing a model's graphdef walks its whole
    tree (~10 ms a step for the 4-layer benchmark model on a 2-core host, a third of a decode
    step). Keys are interned (:func:`step_key`), so engines of the same model share compiled
    programs and a lookup compares by identity.
    """

    __slots__ = ("graphdef", "spec", "tokens", "_hash")

    def __init__(self, graphdef, spec: CacheSpec, tokens: int | None = None):
        self.graphdef, self.spec, self.tokens = graphdef, spec, tokens
        self._hash = hash((graphdef, spec, tokens))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, StepKey)
            and self._hash == other._hash
            and (self.graphdef, self.spec, self.tokens) == (other.graphdef, other.spec, other.tokens)
        )


_STEP_KEYS: dict[StepKey, StepKey] = {}


def step_key(graphdef, spec: CacheSpec, tokens: int | None = None) -> StepKey:
    """The interned :class:`StepKey` of ``(graphdef, spec, tokens)``."""
    key = StepKey(graphdef, spec, tokens)
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


def warm_shapes(max_rows: int, max_chunk: int, floors: dict[int, int], images: bool) -> list[Shape]:
    """Covers of every step with at most ``max_rows`` rows in each group (bucketed), prefill chunks
    of at most ``max_chunk`` tokens and a page-table width among ``floors`` (``{width: the decode
    group's floor of rows}``), all masked (a mask of all ones changes nothing). Per width: a quiet
    server's steps (the smallest decode group, one prompt's chunk alone), one prompt joining a full
    decode group (a busy server's admissions), and a step with every row in both groups, which
    covers all the others; then, per width, the largest decode group (a busy server's decode
    steps, which the previous ones cover at the cost of their prefill rows)."""
    first = []
    for M, floor in floors.items():
        first += [
            (floor, 0, 0, M),
            (0, 1, max_chunk, M),
            (max_rows, 1, max_chunk, M),
            (max_rows, max_rows, max_chunk, M),
        ]
    then = [(max_rows, 0, 0, M) for M in floors]
    return [Shape(*dims, masked=True, images=images) for dims in dict.fromkeys(first + then)]


class Programs:
    """The shapes an engine has compiled, and the compiler thread.

    The compiler thread takes first the :meth:`warm` covers, in order, then the shape whose steps
    have so far done the most padded work.

    Args:
      compile: ``Shape -> program``, the ahead-of-time compile of one shape's step (run on the
        compiler thread).
      background: compile new shapes on the compiler thread while steps run on covering shapes.
      compile_after: steps of a shape run on a cover before its own program is compiled.
      max_padding: a shape whose cheapest cover costs more than this many times its own work is
        compiled at once.
    """

    def __init__(
        self, compile: Callable[[Shape], Any], background: bool, compile_after: int = 4, max_padding: float = 2.0
    ):
        if compile_after < 1 or not max_padding >= 1:
            raise ValueError(f"compile_after must be >= 1 and max_padding >= 1, got {compile_after}, {max_padding}")
        self._compile = compile
        self.background = background
        self.compile_after, self.max_padding = compile_after, max_padding
        self._met: dict[Shape, tuple[int, int]] = {}  # per shape not compiled: steps run on a cover, work padded
        self._warm: list[Shape] = []  # compiled ahead of any step (again after forget)
        self.known: set[Shape] = set()  # compiled by the step's jit (on the engine thread)
        self.ready: dict[Shape, Any] = {}  # compiled ahead of time (on the compiler thread)
        self.pending: set[Shape] = set()  # queued or compiling
        self._queued: dict[Shape, None] = {}  # in the order queued; the compiler thread takes by _priority
        self.failed: set[Shape] = set()  # the compiler thread failed: the step compiles (and raises) itself
        self.padded_steps = 0  # steps run on a covering shape
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def choose(self, want: Shape) -> Shape:
        """The shape to run a step of shape ``want`` on: ``want`` itself once it is compiled (or
        when nothing compiled covers it), else the cheapest compiled shape that covers it; ``want``
        is queued for the compiler thread once met ``compile_after`` times, or at once when that
        cover costs over ``max_padding`` times its work."""
        if not self.background or want in self.known or want in self.failed:
            return want
        with self._lock:
            if want in self.ready:
                return want
            covering = [s for s in (*self.known, *self.ready) if s.covers(want)]
            if not covering:
                return want
            cover = min(covering, key=Shape.cost)
            met, padded = self._met.get(want, (0, 0))
            met, padded = self._met[want] = met + 1, padded + cover.cost() - want.cost()
            if met >= self.compile_after or cover.cost() > self.max_padding * want.cost():
                self._enqueue(want)
        self.padded_steps += 1
        return cover

    def warm(self, shapes: list[Shape]) -> list[Shape]:
        """Queues ``shapes`` for the compiler thread (those not compiled or queued yet): covers for
        the steps to come, compiled before any step needs them. Returns the shapes queued or held."""
        if not self.background:
            return []
        with self._lock:
            self._warm = list(shapes)
            self._enqueue_warm()
        return self._warm

    def _enqueue_warm(self) -> None:  # under the lock; ahead of every other shape, in their order
        for shape in self._warm:
            if shape not in self.known and shape not in self.ready:
                self._enqueue(shape)

    def _enqueue(self, shape: Shape) -> None:  # under the lock
        if shape not in self.pending:
            self.pending.add(shape)
            self._queued[shape] = None
            self._work.notify()
            self._start()

    def count(self) -> int:
        """Programs held: compiled by the step's jit, ahead of time, or compiling now."""
        with self._lock:
            return len(self.known) + len(self.ready) + len(self.pending)

    def compiling(self) -> int:
        """Shapes queued for or compiling on the compiler thread."""
        with self._lock:
            return len(self.pending)

    def forget(self) -> None:
        """Drops every compiled program (the caller cleared the step's jit cache); pending ones stay,
        and the :meth:`warm` covers are queued again."""
        with self._lock:
            self.known.clear()
            self.ready.clear()
            self._met.clear()
            self._enqueue_warm()

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

    def _priority(self, shape: Shape) -> float:  # under the lock
        return float("inf") if shape in self._warm else self._met.get(shape, (0, 0))[1]

    def _loop(self) -> None:
        while True:
            with self._work:
                self._work.wait_for(lambda: self._queued)
                shape = max(self._queued, key=self._priority)  # the first of equals: warm ones in order
                del self._queued[shape]
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
