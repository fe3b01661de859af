"""The inference engine: continuous batching over paged hybrid caches, one jitted step.

    engine = Engine(model, EngineConfig(cache_bytes=2**30), eos_id=tokenizer.eos_id)
    outputs = engine.generate([Request(prompt_ids=(...), max_tokens=64)])

Each :meth:`Engine.step` asks the :class:`Scheduler` for rows, zeroes freed pages and slots and
copies prefix pages (one small program), then runs the model over the rows
(:func:`jaxmoe.inference.forward.forward`) and samples the next token of every row that reached
the end of its pending tokens. Shapes are bucketed to powers of two (rows, tokens per row,
pages per row), so the step compiles a handful of times, not once per request; with
``EngineConfig.compile_in_background`` (the server's setting) a step of a shape met for the first
time runs padded to a compiled one while its own program compiles on another thread
(:mod:`jaxmoe.inference.programs`).

On a mesh (``Engine(..., mesh=...)``) the weights keep the training rules' sharding (tensor,
expert, fsdp axes), the pools are replicated, and the same program runs on every device; in a
multi-process run process 0 schedules and broadcasts each step's arrays to the others, which
run the same jitted step (:meth:`Engine.serve_follower`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.inference.allocator import pages_for
from jaxmoe.inference.cache import DEFAULT_PAGE_SIZE, CacheSpec, maintain, maintenance, warm_maintenance
from jaxmoe.inference.forward import Rows, forward, last_hidden, write
from jaxmoe.inference.images import ImageFeatures
from jaxmoe.inference.multihost import Work, broadcast
from jaxmoe.inference.programs import Programs, Shape, StepKey, abstract_inputs, shape_of, step_key, warm_shapes
from jaxmoe.inference.sampler import RowSampling, sample
from jaxmoe.inference.scheduler import Plan, Request, Scheduler, Sequence
from jaxmoe.sharding import state_shardings
from jaxmoe.vision.layout import pad_patches


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine.

    Attributes:
      cache_bytes: device memory for the pools (pages and slots), allocated once.
      page_size: positions per page.
      max_seqs: most sequences running at once (each holds a KDA slot).
      snapshot_slots: extra KDA slots for prefix snapshots.
      step_tokens: token budget of one step (decode tokens + prefill chunks).
      chunk_size: most prompt tokens of one sequence in one step.
      prefix_cache: keep finished tenants' prefixes for reuse.
      compile_in_background: run a step of a shape met for the first time padded to a compiled
        shape while its own program compiles on another thread (a server's latency), instead of
        compiling it before the step (bit-reproducible outputs). Engines without a mesh only: on a
        mesh the pools take the layout XLA gives the first write's output, which a program compiled
        ahead of time from their initial layout would refuse.
      image_cache: most images whose vision features are kept for the tenant's next request (an
        agent re-sends its images every turn; the tower runs once per image, like its prefix).
      min_decode_rows, min_context: floors of the decode group's rows (at most ``max_seqs``) and
        of the positions the page table covers, for batch jobs (RL rollouts, evaluations): their rows finish at
        different steps and their prompts differ in length, and without floors each power of two of
        rows still running and of pages used is a step shape of its own. Padding rows and pages
        change no real row's result (see :mod:`jaxmoe.inference.programs`). 0: the engine's own
        floors only.
      max_programs: most step shapes kept compiled. Meeting a new shape with this many compiled,
        or with the process holding over half of the ``vm.max_map_count`` memory maps Linux allows
        it (65,530 by default), drops them all (they recompile as they are met again): XLA:CPU maps
        each program's code into memory sections of its own, ~1,000 maps for the tiny model's step
        on 8 devices, and an RL run meeting a few new shapes a step died of it ("LLVM ERROR: Unable
        to allocate section memory"). Outputs do not depend on it: every step still runs on its
        own shape.
    """

    cache_bytes: int = 1 << 28
    page_size: int = DEFAULT_PAGE_SIZE
    max_seqs: int = 16
    snapshot_slots: int = 16
    step_tokens: int = 256
    chunk_size: int = 128
    prefix_cache: bool = True
    compile_in_background: bool = False
    max_programs: int = 48
    image_cache: int = 64
    min_decode_rows: int = 0
    min_context: int = 0

    def __post_init__(self):
        for name in ("cache_bytes", "page_size", "max_seqs", "step_tokens", "chunk_size", "max_programs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("snapshot_slots", "image_cache", "min_decode_rows", "min_context"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass
class Completion:
    """What a request produced."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or a stop string), "length", "cancelled"
    text: str | None
    prompt_tokens: int
    cached_tokens: int
    image_tokens: int = 0  # prompt tokens that are image placeholders (counted in prompt_tokens)


# Bucket floors, so that the few small shapes of a quiet engine share one program: a page table
# has at least 8 pages, and a decode group at least 64 / (its page-table width) rows, at most 8.
# A padding row attends over the whole page table like a real one, so short rows are padded
# (64 pages of padding at most: cheap next to a compile) and a long row is never.
MIN_PAGES = 8
PADDED_ROW_PAGES = 64
MAX_DECODE_FLOOR = 8


def memory_maps() -> tuple[int, int] | None:
    """``(maps held, vm.max_map_count)`` of this process, or None where /proc does not tell (not Linux).

    XLA:CPU's code sections of a large program take ~1,000 maps (the tiny model's step on 8 devices),
    so a program count alone does not bound them.
    """
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


def _bucket(n: int, minimum: int = 1) -> int:
    """The power of two at or above ``max(n, minimum)``."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def _step(key: StepKey, all_logits: bool, state, cache, groups, sampling):
    model = nnx.merge(key.graphdef, state)
    hidden, writes = forward(model, key.spec, cache, groups, key.tokens)
    last = jnp.concatenate([last_hidden(h, g) for h, g in zip(hidden, groups)], axis=0)  # [B, D]
    tokens, logprobs = sample(model.head(last), sampling)
    if not jax.sharding.get_abstract_mesh().empty:  # every process reads its own full copy
        replicated = jax.sharding.PartitionSpec()
        tokens, logprobs = (jax.lax.with_sharding_constraint(a, replicated) for a in (tokens, logprobs))
    logits = [model.head(h) for h in hidden] if all_logits else None
    return tokens, logprobs, writes, logits


# The step reads the pools; a second program stores its writes into the donated pools in place.
_step_jit = jax.jit(_step, static_argnums=(0, 1))
_write_jit = jax.jit(write, donate_argnums=(0,))
# A request's images through the vision tower, once at submission (patches padded to a power of two).
_vision_jit = jax.jit(lambda graphdef, state, inputs: nnx.merge(graphdef, state).vision(inputs), static_argnums=0)


class Engine:
    """Continuous-batching generation for one model.

    Args:
      model: a :class:`jaxmoe.model.Transformer` (its MoE should use a dropless dispatch).
      config: the :class:`EngineConfig`.
      eos_id: the end-of-sequence id (None: only ``max_tokens`` and stop strings end a request).
      detokenize: ids -> text, for stop strings and ``Completion.text``.
      mesh: optional mesh the model is sharded over.
    """

    def __init__(
        self,
        model,
        config: EngineConfig = EngineConfig(),
        *,
        eos_id: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.cfg = model.cfg
        self.config = config
        self.eos_id, self.detokenize, self.mesh = eos_id, detokenize, mesh
        num_slots = config.max_seqs + config.snapshot_slots
        self.spec = CacheSpec.from_budget(
            model.cfg, config.cache_bytes, num_slots=num_slots, page_size=config.page_size
        )
        self.graphdef, self.state = nnx.split(model)
        self._key = step_key(self.graphdef, self.spec, config.step_tokens)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None
        self.cache = self.spec.init(sharding)
        # What the step is lowered for ahead of time (no mesh): the weights' and the pools' avals and devices.
        self._abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (self.state, self.cache)
        )
        self.programs = Programs(self._compile, background=config.compile_in_background and mesh is None)
        self.scheduler = Scheduler(
            num_pages=self.spec.num_pages,
            num_slots=num_slots,
            page_size=config.page_size,
            max_seqs=config.max_seqs,
            step_tokens=config.step_tokens,
            chunk_size=config.chunk_size,
            prefix_cache=config.prefix_cache,
        )
        self._next_id = 0
        self.sequences: dict[int, Sequence] = {}
        # prefill_tokens: positions computed below a sequence's length at admission (prompt, or a
        # preempted sequence's prompt + output again); decode_tokens: the rest; cached_tokens: taken
        # from prefix entries instead of computed.
        # padded_steps: steps run on a covering shape (compile_in_background); compiles_on_the_spot:
        # steps that compiled their own program before they ran.
        names = ("steps", "prefill_tokens", "decode_tokens", "cached_tokens", "padded_steps", "program_evictions")
        self.stats = dict.fromkeys((*names, "compiles_on_the_spot", "image_encodes"), 0)
        self.images = ImageFeatures(model.cfg.vision, model.cfg.d_model, config.image_cache)

    # ------------------------------------------------------------------------------------
    # Requests

    def submit(self, request: Request) -> int:
        """Queues ``request``; returns its id.

        Raises:
          ValueError: naming the field, for an empty prompt, ids outside the vocabulary, or a
            prompt plus ``max_tokens`` longer than ``model.max_context`` or than the page pool.
        """
        prompt = list(request.prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        V = self.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"prompt_ids must be in [0, {V}): got ids from {min(prompt)} to {max(prompt)}")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if not 0 <= request.min_tokens <= request.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={request.max_tokens}], got {request.min_tokens}")
        total = len(prompt) + request.max_tokens
        if total > self.cfg.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds the model's "
                f"max_context {self.cfg.max_context}"
            )
        capacity = self.scheduler.pages.capacity * self.config.page_size
        if self.spec.token_bytes and total > capacity:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds the page pool "
                f"({self.scheduler.pages.capacity} pages x {self.config.page_size} = {capacity} tokens); raise the "
                "cache budget"
            )
        if request.stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenizer (a checkpoint with a tokenizer)")
        seq = Sequence(id=self._next_id, request=request, tokens=prompt)
        self.stats["image_encodes"] += self.images.attach(seq, self._encode)
        self._next_id += 1
        self.sequences[seq.id] = seq
        self.scheduler.submit(seq)
        return seq.id

    def _encode(self, inputs) -> np.ndarray:
        """``[merged, D]`` float32 features of a batch of images (patches padded to a power-of-two
        count of merge blocks, so few programs serve all image sizes)."""
        K = self.cfg.vision.merge_size
        total = K * _bucket(inputs.patches.shape[0] // K, 4)
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            merged = _vision_jit(self.graphdef, self.state, pad_patches(inputs, total))
        return np.asarray(_host(merged), np.float32)

    def cancel(self, seq_id: int) -> None:
        """Stops a waiting or running request; its pages and slot go back to the pools."""
        seq = self.sequences[seq_id]
        if seq.finish_reason is None:
            self.scheduler.finish(seq, "cancelled")

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def completion(self, seq_id: int) -> Completion:
        seq = self.sequences[seq_id]
        return Completion(
            output_ids=list(seq.output),
            logprobs=list(seq.logprobs),
            finish_reason=seq.finish_reason,
            text=seq.text,
            prompt_tokens=len(seq.request.prompt_ids),
            cached_tokens=seq.cached_tokens,
            image_tokens=0 if seq.features is None else len(seq.features),
        )

    def generate(self, requests: Iterable[Request], progress: Callable[[int], None] | None = None) -> list[Completion]:
        """Runs ``requests`` together to completion; results in input order.

        Raises:
          ValueError: ``request N: ...`` for the first request :meth:`submit` refuses.
        """
        ids = []
        for i, r in enumerate(requests):
            try:
                ids.append(self.submit(r))
            except ValueError as e:
                raise ValueError(f"request {i + 1}: {e}") from e
        while self.has_work():
            done = self.step()
            if progress is not None and done:
                progress(len(done))
        return [self.completion(i) for i in ids]

    # ------------------------------------------------------------------------------------
    # A step

    def step(self) -> list[int]:
        """Schedules and runs one step; returns the ids of the requests that finished in it.

        In a multi-process run only process 0 calls this; the others run :meth:`follow`.
        """
        plan = self.scheduler.schedule()
        groups, sampling, order = self._arrays(plan) if plan.rows else ((), None, [])
        upkeep = None
        if plan.zero_pages or plan.zero_slots or plan.copy_pages or plan.copy_slots:
            upkeep = maintenance(
                self.spec,
                zero_pages=plan.zero_pages,
                zero_slots=plan.zero_slots,
                copy_pages=plan.copy_pages,
                copy_slots=plan.copy_slots,
            )
        out = self.execute(broadcast(Work(upkeep, groups, sampling)))
        self.stats["cached_tokens"] = self.scheduler.cached_tokens
        self.stats["padded_steps"] = self.programs.padded_steps
        if not plan.rows:
            return []
        self.stats["steps"] += 1
        return self._advance(plan, order, *out)

    def execute(self, work: Work):
        """Runs a step's work (every process the same): maintenance, then the model and the sampler.

        Returns:
          ``(tokens, logprobs)`` as numpy arrays, or None when the step has no rows.
        """
        if work.maintenance is not None:
            with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
                self.cache = maintain(self.cache, work.maintenance)
        if not work.groups:
            return None
        tokens, logprobs = self.run_arrays(work.groups, work.sampling)
        return _host(tokens), _host(logprobs)

    def follow(self) -> None:
        """A non-zero process of a multi-process run: runs process 0's steps until it says stop."""
        while (work := broadcast(None)) is not None:
            self.execute(work)

    def stop_followers(self) -> None:
        """Process 0: tells the :meth:`follow` loops of the other processes to return."""
        if jax.process_count() > 1:
            broadcast(None)

    def _make_room(self) -> None:
        """Drops every compiled step program once ``max_programs`` are held, or once the process holds
        more than half the memory maps it may (see :class:`EngineConfig`)."""
        maps = memory_maps()
        crowded = maps is not None and maps[0] > maps[1] // 2
        if self.programs.count() < self.config.max_programs and not crowded:
            return
        _step_jit.clear_cache()
        _write_jit.clear_cache()
        self.programs.forget()
        self.stats["program_evictions"] += 1

    def warm_up(self, context: int) -> list[Shape]:
        """With ``compile_in_background``, before any step: compiles the pools' maintenance and queues
        for the compiler thread covers of every step up to ``context`` positions (:func:`warm_shapes`),
        so that none compiles on the spot. Returns the covers."""
        if context <= 0 or not self.programs.background:
            return []
        c, top = self.config, _bucket(pages_for(context, self.config.page_size), MIN_PAGES)
        floors = {M: self._decode_floor(M) for M in (MIN_PAGES << k for k in range((top // MIN_PAGES).bit_length()))}
        self.cache = warm_maintenance(self.cache, self.spec, top)
        chunk = _bucket(min(c.chunk_size, c.step_tokens), minimum=8)
        return self.programs.warm(warm_shapes(_bucket(c.max_seqs), chunk, floors, self.cfg.vision is not None))

    def run_arrays(self, groups, sampling, all_logits: bool = False):
        """The jitted step on host arrays (what every process of a multi-process run executes)."""
        real = sum(int(np.sum(g.length)) for g in groups)  # the step's FFN holds step_tokens (forward)
        if real > self.config.step_tokens:
            raise ValueError(f"a step of {real} tokens exceeds the engine's step_tokens={self.config.step_tokens}")
        shape = shape_of(groups, sampling)
        program = None if all_logits else self.programs.program(shape)
        if program is None and not all_logits and shape not in self.programs.known:
            self._make_room()
            self.stats["compiles_on_the_spot"] += 1
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            if program is not None:
                step, store = program
                tokens, logprobs, writes, logits = step(self.state, self.cache, groups, sampling)
                self.cache = store(self.cache, groups, writes)
            else:
                tokens, logprobs, writes, logits = _step_jit(
                    self._key, all_logits, self.state, self.cache, groups, sampling
                )
                self.cache = _write_jit(self.cache, groups, writes)
                if not all_logits:
                    self.programs.known.add(shape)
        return (tokens, logprobs, logits) if all_logits else (tokens, logprobs)

    def _compile(self, shape: Shape):
        """The step and write programs of ``shape``, compiled ahead of time (the compiler thread)."""
        groups, sampling = abstract_inputs(shape, self.cfg.vocab_size, self.cfg.d_model)
        state, cache = self._abstract
        lowered = _step_jit.lower(self._key, False, state, cache, groups, sampling)
        writes = lowered.out_info[2]
        return lowered.compile(), _write_jit.lower(cache, groups, writes).compile()

    def _arrays(self, plan: Plan):
        """Host arrays of the plan: the decode group (T = 1) and the prefill group, bucketed."""
        decode = [(s, n) for s, n in plan.rows if s.pending == 1]
        prefill = [(s, n) for s, n in plan.rows if s.pending > 1]
        masks = self._masks(plan)
        # One page-table width for both groups: the step compiles per (decode rows, prefill rows,
        # chunk, width), not per width of each group as well.
        c = self.config
        M = _bucket(pages_for(max(c.min_context, *(s.computed + n for s, n in plan.rows)), c.page_size), MIN_PAGES)
        floor = self._decode_floor(M)
        shape = self.programs.choose(
            Shape(
                decode_rows=_bucket(len(decode), floor) if decode else 0,
                prefill_rows=_bucket(len(prefill)) if prefill else 0,
                chunk=_bucket(max(n for _, n in prefill), minimum=8) if prefill else 0,
                pages=M,
                masked=bool(masks),
                images=any(s.image_rows(s.computed, n) is not None for s, n in plan.rows),
            )
        )
        groups, order = [], []
        for rows, B, T in ((decode, shape.decode_rows, 1), (prefill, shape.prefill_rows, shape.chunk)):
            if B:
                groups.append(self._group(rows, B, T, shape.pages, shape.images))
                order += [s for s, _ in rows] + [None] * (B - len(rows))
        mask = None
        if shape.masked:
            mask = np.ones((len(order), self.cfg.vocab_size), bool)
            for b, seq in enumerate(order):
                if seq is not None and seq.id in masks:
                    mask[b] = masks[seq.id]
        return tuple(groups), _sampling(order, mask), order

    def _decode_floor(self, pages: int) -> int:
        c, floor = self.config, min(MAX_DECODE_FLOOR, self.config.max_seqs, max(1, PADDED_ROW_PAGES // pages))
        return max(floor, min(c.min_decode_rows, c.max_seqs))

    def _masks(self, plan: Plan) -> dict[int, np.ndarray]:
        """``{sequence id: [V] allowed tokens}`` of the restricted rows that sample in this step: by
        their constraint, and before ``min_tokens`` by their stop tokens (unless nothing else is allowed)."""
        masks = {}
        for seq, n in plan.rows:
            if seq.pending != n:
                continue
            allowed = self._allowed(seq)
            if len(seq.output) < seq.request.min_tokens:
                free = np.ones((self.cfg.vocab_size,), bool) if allowed is None else allowed.copy()
                free[self._stop_tokens(seq.request)] = False
                allowed = free if free.any() else allowed
            if allowed is not None:
                masks[seq.id] = allowed
        return masks

    def _allowed(self, seq: Sequence) -> np.ndarray | None:
        if seq.request.constraint is None:
            return None
        allowed = seq.request.constraint.allowed()
        if allowed is not None and (allowed.shape != (self.cfg.vocab_size,) or not allowed.any()):
            raise ValueError(
                f"request {seq.id}: its constraint allowed {int(allowed.sum())} tokens of a "
                f"{allowed.shape} mask; need a non-empty bool [{self.cfg.vocab_size}] mask"
            )
        return allowed

    def _stop_tokens(self, r: Request) -> list[int]:
        ids = [i for i in r.stop_ids if 0 <= i < self.cfg.vocab_size]
        if not r.ignore_eos and self.eos_id is not None and 0 <= self.eos_id < self.cfg.vocab_size:
            ids.append(self.eos_id)
        return ids

    def _group(self, rows: list[tuple[Sequence, int]], B: int, T: int, M: int, images: bool = False) -> Rows:
        """``rows`` in a ``[B, T]`` group with ``M``-page tables (the rows past them: padding); with
        ``images``, the image features of their image tokens."""
        tokens = np.zeros((B, T), np.int32)
        start = np.zeros((B,), np.int32)
        length = np.zeros((B,), np.int32)
        pages = np.zeros((B, M), np.int32)
        slot = np.full((B,), self.spec.num_slots, np.int32)
        for b, (s, n) in enumerate(rows):
            tokens[b, :n] = s.tokens[s.computed : s.computed + n]
            start[b], length[b] = s.computed, n
            pages[b, : len(s.pages)] = s.pages
            slot[b] = s.slot
        if not images:
            return Rows(tokens, start, length, pages, slot)
        embeds = np.zeros((B, T, self.cfg.d_model), np.float32)
        from_image = np.zeros((B, T), bool)
        for b, (s, n) in enumerate(rows):
            feature_rows = s.image_rows(s.computed, n)
            if feature_rows is not None:
                at = np.nonzero(feature_rows >= 0)[0]
                embeds[b, at] = s.features[feature_rows[at]]
                from_image[b, at] = True
        return Rows(tokens, start, length, pages, slot, embeds, from_image)

    def _advance(self, plan, order, tokens, logprobs) -> list[int]:
        """Book-keeping after the step: computed counts, sampled tokens, stops."""
        done = []
        sizes = {id(s): n for s, n in plan.rows}
        for i, seq in enumerate(order):
            if seq is None:
                continue
            n = sizes[id(seq)]
            prefill = max(0, min(seq.computed + n, seq.admitted_tokens) - seq.computed)
            self.stats["prefill_tokens"] += prefill
            self.stats["decode_tokens"] += n - prefill
            seq.computed += n
            if seq.pending > 0:  # a prompt chunk that did not reach the end: nothing to sample
                continue
            token = int(tokens[i])
            seq.tokens.append(token)
            seq.output.append(token)
            seq.logprobs.append(float(logprobs[i]))
            if seq.request.constraint is not None:
                seq.request.constraint.accept(token)
            reason = self._finish_reason(seq, token)
            if reason is None and seq.computed == len(seq.request.prompt_ids):
                self.scheduler.snapshot_prompt(seq)
            if reason is not None:
                self._set_text(seq)
                self.scheduler.finish(seq, reason)
                done.append(seq.id)
        return done

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        r = seq.request
        if (token == self.eos_id and not r.ignore_eos) or token in r.stop_ids:
            return "stop"  # before min_tokens only when the constraint allowed nothing else
        if r.stop and len(seq.output) >= r.min_tokens and any(s in self._text(seq) for s in r.stop):
            return "stop"
        if len(seq.output) >= r.max_tokens:
            return "length"
        return None

    def _text(self, seq: Sequence) -> str:
        ended = seq.output and (seq.output[-1] == self.eos_id or seq.output[-1] in seq.request.stop_ids)
        ids = seq.output[:-1] if ended else seq.output
        return self.detokenize(ids)

    def _set_text(self, seq: Sequence) -> None:
        if self.detokenize is None:
            return
        text = self._text(seq)
        cuts = [text.find(s) for s in seq.request.stop if s in text]
        seq.text = text[: min(cuts)] if cuts else text


def place(model, mesh: jax.sharding.Mesh):
    """``model`` with every weight sharded over ``mesh`` by the training rules (tensor, expert, fsdp axes).

    Each process passes the same host values (the same checkpoint), so this works across
    processes as well: every process builds its own shards of one global array.
    """
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)

    def put(sharding, value):
        def one(x):
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(one, value)

    return nnx.merge(graphdef, jax.tree.map(put, shardings, state))


def _host(x: jax.Array) -> np.ndarray:
    """A replicated result on the host (in a multi-process run, this process's copy)."""
    return np.asarray(x.addressable_data(0)) if jax.process_count() > 1 else np.asarray(x)


def _sampling(order: list, mask: np.ndarray | None = None) -> RowSampling:
    B = len(order)
    temperature = np.zeros((B,), np.float32)
    top_p = np.ones((B,), np.float32)
    top_k = np.zeros((B,), np.int32)
    seed = np.zeros((B,), np.uint32)
    index = np.zeros((B,), np.int32)
    for b, seq in enumerate(order):
        if seq is None:
            continue
        p = seq.request.sampling
        temperature[b], top_p[b], top_k[b], seed[b] = p.temperature, p.top_p, p.top_k, p.seed
        index[b] = len(seq.output)
    return RowSampling(temperature, top_p, top_k, seed, index, mask)
