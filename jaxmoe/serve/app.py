"""``jaxmoe serve``: the FastAPI app over one engine, and its construction from a checkpoint.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI),
``POST /v1/messages``, ``POST /v1/messages/count_tokens`` (Anthropic), ``GET /metrics``
(Prometheus), ``GET /health``. Every route but ``/health`` needs a key (``Authorization: Bearer
KEY`` or ``x-api-key: KEY``) when keys are configured; the key's identity is the tenant that
scopes prefix reuse. Errors come back in the shape of the API of the route.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from jaxmoe.serve import anthropic_api, openai_api
from jaxmoe.serve.auth import ANONYMOUS, KeyChecker
from jaxmoe.serve.errors import APIError, error_response
from jaxmoe.serve.metrics import Metrics
from jaxmoe.serve.runner import EngineRunner
from jaxmoe.serve.service import Service
from jaxmoe.serve.tiers import DEFAULT_BUDGETS, DEFAULT_SLOTS, TIERS, TierGate
from jaxmoe.vision.preprocess import ImageLimits

log = logging.getLogger(__name__)
_OPEN_PATHS = ("/health",)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What ``jaxmoe serve`` takes besides the checkpoint (see ``jaxmoe serve --help``)."""

    model_name: str | None = None
    api_keys: dict[str, str] | None = None
    budgets: dict[str, int] = dataclasses.field(default_factory=lambda: dict(DEFAULT_BUDGETS))
    slots: dict[str, int] = dataclasses.field(default_factory=lambda: dict(DEFAULT_SLOTS))
    max_queue: int = 64
    request_timeout: float | None = 600.0
    cache_bytes: int = 1 << 30
    page_size: int = 16
    step_tokens: int = 256
    chunk_size: int = 128
    warmup_context: int = 8192
    image_limits: ImageLimits = ImageLimits()


def create_app(service: Service) -> FastAPI:
    """The app over ``service`` (its runner is started and stopped with the app)."""

    async def lifespan(app):
        service.runner.start()
        await service.warm_up()
        yield
        service.runner.stop()

    app = FastAPI(title="jaxmoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    app.add_middleware(_Authenticate, checker=service.checker)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return error_response(APIError(400, f"invalid request: {error.errors()}"), request.url.path)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        log.exception("request failed")
        return error_response(APIError(500, f"internal error: {type(error).__name__}: {error}"), request.url.path)

    @app.get("/health")
    async def health():
        alive = service.runner.healthy
        body = {"status": "ok" if alive else "engine stopped", "compiling": service.runner.engine.programs.compiling()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    return app


class _Authenticate:
    """Pure ASGI middleware: a key on every route but /health; the key's tenant in ``request.state``.

    (Not ``@app.middleware("http")``: behind that wrapper ``request.is_disconnected()`` never turns
    true, and abandoned requests would run to the end.)
    """

    def __init__(self, app, checker: KeyChecker):
        self.app, self.checker = app, checker

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = self.checker.tenant(headers) if self.checker.enabled else ANONYMOUS
        if tenant is None:
            error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
            return await error_response(error, scope["path"])(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)


def _page_metrics(metrics: Metrics):
    """Pool gauges after each step: pages of live requests, pages only prefix entries hold, capacity."""

    def update(engine) -> None:
        sched = engine.scheduler
        live = {p for s in sched.running for p in s.pages}
        prefix = sched.prefix.pages() - live if sched.prefix is not None else set()
        metrics.set_cache_pages(len(live), len(prefix), sched.pages.capacity)

    return update


def build_service(checkpoint: str | pathlib.Path, config: ServeConfig) -> Service:
    """Loads ``checkpoint`` (a training workdir, checkpoint root or model checkpoint) behind a new engine."""
    from jaxmoe.inference.engine import Engine, EngineConfig  # noqa: PLC0415
    from jaxmoe.inference.generate import load_for_generation  # noqa: PLC0415

    cfg, model, tokenizer = load_for_generation(checkpoint)
    if tokenizer is None:
        raise FileNotFoundError(f"--checkpoint {str(checkpoint)!r} has no tokenizer.json (the server needs one)")
    max_seqs = sum(config.slots.values())
    engine_config = EngineConfig(
        cache_bytes=config.cache_bytes,
        page_size=config.page_size,
        max_seqs=max_seqs,
        snapshot_slots=2 * max_seqs,
        step_tokens=max(config.step_tokens, max_seqs),
        chunk_size=config.chunk_size,
        compile_in_background=True,  # a new shape runs padded to a compiled one instead of stalling every request
        max_programs=96,  # the --warmup-context covers (5 a page-table width) and the shapes met most
    )
    engine = Engine(model, engine_config, eos_id=tokenizer.eos_id, detokenize=tokenizer.decode)
    engine.warm_up(min(config.warmup_context, cfg.model.max_context))  # in the background, while requests run
    metrics = Metrics(TIERS)
    runner = EngineRunner(engine, on_step=_page_metrics(metrics))
    _page_metrics(metrics)(engine)
    name = config.model_name or (cfg.name if cfg.name != "unnamed" else pathlib.Path(str(checkpoint)).name)
    return Service(
        tokenizer=tokenizer,
        runner=runner,
        gate=TierGate(config.slots, config.max_queue, metrics),
        metrics=metrics,
        checker=KeyChecker(config.api_keys),
        model_name=name,
        budgets=config.budgets,
        max_context=cfg.model.max_context,
        vocab_size=cfg.model.vocab_size,
        request_timeout=config.request_timeout,
        vision=cfg.model.vision,
        image_limits=config.image_limits,
    )
