"""The engine on a thread of its own, fed by the server's event loop.

The engine is synchronous: one :meth:`Engine.step` after another. The runner's thread owns it;
request handlers (coroutines on the server's event loop) never touch it. They send commands
(submit, cancel) through a thread-safe queue that the thread drains between steps, and receive
each step's new tokens for their request on an ``asyncio.Queue`` filled with
``loop.call_soon_threadsafe``. A request that is cancelled (client gone, timeout) returns its
pages and slot to the pools at the next step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator

from jaxmoe.inference.engine import Completion, Engine
from jaxmoe.inference.scheduler import Request

log = logging.getLogger(__name__)
_UNHEALTHY_AFTER = 3  # engine steps failed in a row before /health says so


@dataclasses.dataclass
class Update:
    """What one step produced for a request: new token ids, and the completion once it is done."""

    tokens: list[int]
    completion: Completion | None = None
    error: Exception | None = None


@dataclasses.dataclass
class _Tracked:
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    sent: int = 0


class EngineRunner:
    """Runs ``engine`` on a daemon thread; :meth:`generate` streams one request's tokens."""

    def __init__(self, engine: Engine, on_step=None):
        """Args:
        engine: the engine (only this runner's thread uses it from now on).
        on_step: optional ``callable(engine)`` run on the engine thread after every step (metrics).
        """
        self.engine = engine
        self._on_step = on_step
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[int, _Tracked] = {}
        self._thread = threading.Thread(target=self._loop, name="jaxmoe-engine", daemon=True)
        self._stopping = False
        self._failures = 0  # engine steps failed in a row

    @property
    def healthy(self) -> bool:
        """The thread runs and its last steps did not all fail (a few failures in a row: not healthy)."""
        return self._thread.is_alive() and self._failures < _UNHEALTHY_AFTER

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop", None, None))
        self._thread.join(timeout)

    async def generate(self, request: Request) -> AsyncIterator[Update]:
        """Submits ``request`` and yields its updates until it finishes.

        Raises:
          ValueError: the engine refused the request (naming the field).
        Closing the iterator early (client disconnect, timeout) cancels the request.
        """
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        tracked = _Tracked(loop, asyncio.Queue())
        self._commands.put(("submit", (request, tracked), accepted))
        seq_id = await accepted  # raises the engine's ValueError
        done = False
        try:
            while True:
                update: Update = await tracked.updates.get()
                if update.error is not None:
                    done = True
                    raise update.error
                yield update
                if update.completion is not None:
                    done = True
                    return
        finally:
            if not done:
                self._commands.put(("cancel", seq_id, None))

    # ------------------------------------------------------------------------------------
    # The engine thread

    def _loop(self) -> None:
        while not self._stopping:
            block = not self.engine.has_work()
            try:
                self._drain(block)
            except Exception:  # a command must never kill the thread
                log.exception("engine command failed")
            if self._stopping:
                break
            if not self.engine.has_work():
                continue
            try:
                finished = set(self.engine.step())
            except Exception as e:  # fail what was running, keep serving the rest
                log.exception("engine step failed")
                self._failures += 1
                self._fail_all(e)
                continue
            self._failures = 0
            self._publish(finished)
            if self._on_step is not None:
                self._on_step(self.engine)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, payload, future = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                return
            block = False
            if kind == "stop":
                return
            if kind == "submit":
                self._submit(payload, future)
            elif kind == "cancel" and payload in self._tracked:
                self._cancel(payload)

    def _cancel(self, seq_id: int) -> None:
        self._tracked.pop(seq_id)
        self.engine.cancel(seq_id)
        del self.engine.sequences[seq_id]
        if self._on_step is not None:
            self._on_step(self.engine)

    def _submit(self, payload, future: asyncio.Future) -> None:
        request, tracked = payload
        try:
            seq_id = self.engine.submit(request)
        except Exception as e:
            tracked.loop.call_soon_threadsafe(self._settle, future, None, e)
            return
        self._tracked[seq_id] = tracked
        tracked.loop.call_soon_threadsafe(self._settle, future, seq_id, None)

    def _settle(self, future: asyncio.Future, seq_id: int | None, error: Exception | None) -> None:
        """On the event loop: the submission's outcome; a handler gone meanwhile gets its request cancelled."""
        if future.cancelled():
            if seq_id is not None:
                self._commands.put(("cancel", seq_id, None))
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(seq_id)

    def _publish(self, finished: set[int]) -> None:
        for seq_id, tracked in list(self._tracked.items()):
            seq = self.engine.sequences[seq_id]
            new = seq.output[tracked.sent :]
            done = seq_id in finished
            if not new and not done:
                continue
            tracked.sent += len(new)
            update = Update(list(new), self.engine.completion(seq_id) if done else None)
            tracked.loop.call_soon_threadsafe(tracked.updates.put_nowait, update)
            if done:
                del self._tracked[seq_id]
                del self.engine.sequences[seq_id]

    def _fail_all(self, error: Exception) -> None:
        for seq_id, tracked in list(self._tracked.items()):
            self.engine.cancel(seq_id)
            del self.engine.sequences[seq_id]
            failure = RuntimeError(f"the engine step failed: {type(error).__name__}: {error}")
            tracked.loop.call_soon_threadsafe(tracked.updates.put_nowait, Update([], error=failure))
        self._tracked.clear()
