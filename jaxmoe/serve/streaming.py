"""Running a job for a route: whole (with disconnect watching) or as server-sent events.

Either way the job first takes one of its tier's slots (``Service.admit``: a 429 is returned before
any byte of a stream), the server's request timeout covers the wait and the generation, and a
client that goes away cancels the engine request, which returns its pages at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from jaxmoe.serve.errors import APIError, anthropic_body, openai_body
from jaxmoe.serve.service import Job, Service

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.25


def respond(body: dict, headers: dict) -> JSONResponse:
    return JSONResponse(body, headers=headers)


def _timeout_error(service: Service) -> APIError:
    return APIError(504, f"the request took longer than the server's request timeout ({service.request_timeout} s)")


async def _watch_disconnect(request, task: asyncio.Task) -> None:
    while not task.done():
        if await request.is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(_DISCONNECT_POLL_S)


async def collect(request, service: Service, job: Job) -> list:
    """All of the job's events and its outcome; cancelled if the client disconnects first."""

    async def run():
        async with service.admit(job.tier):
            return [e async for e in service.events(job, job.call_prefix)]

    task = asyncio.create_task(run())
    watcher = asyncio.create_task(_watch_disconnect(request, task))
    try:
        async with asyncio.timeout(service.request_timeout):
            return await task
    except TimeoutError as e:
        raise _timeout_error(service) from e
    finally:
        task.cancel()
        watcher.cancel()


async def sse_stream(request, service: Service, job: Job, first, chunks, headers: dict, done: str | None = None):
    """A streaming response of ``chunks(event)`` for each event (each a JSON string or (event, JSON)).

    The tier's slot is taken before the response starts (so a full queue is a plain 429) and given
    back when the stream ends, however it ends.
    """
    stack = contextlib.AsyncExitStack()
    loop = asyncio.get_running_loop()
    deadline = None if service.request_timeout is None else loop.time() + service.request_timeout
    admission = asyncio.create_task(stack.enter_async_context(service.admit(job.tier)))
    watcher = asyncio.create_task(_watch_disconnect(request, admission))  # a client gone while queued
    try:
        async with asyncio.timeout_at(deadline):
            await admission
    except TimeoutError as e:
        await stack.aclose()
        raise _timeout_error(service) from e
    except asyncio.CancelledError:
        await stack.aclose()
        raise
    finally:
        watcher.cancel()
    anthropic = request.url.path.startswith("/v1/messages")

    async def events():
        try:
            for c in first if isinstance(first, list) else [first] if first is not None else []:
                yield _sse(c)
            async with asyncio.timeout_at(deadline):
                async for event in service.events(job, job.call_prefix):
                    for c in chunks(event):
                        yield _sse(c)
            if done is not None:
                yield _sse(done)
        except (APIError, TimeoutError, RuntimeError) as e:
            error = e if isinstance(e, APIError) else _timeout_error(service) if isinstance(e, TimeoutError) else None
            error = error or APIError(500, str(e))
            body = anthropic_body(error) if anthropic else openai_body(error)
            yield {"event": "error", "data": json.dumps(body)} if anthropic else {"data": json.dumps(body)}
        finally:
            await stack.aclose()

    return EventSourceResponse(events(), headers=headers, background=BackgroundTask(stack.aclose), ping=10)


def _sse(chunk) -> dict:
    if isinstance(chunk, tuple):
        return {"event": chunk[0], "data": chunk[1]}
    return {"data": chunk}
