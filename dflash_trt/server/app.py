"""The FastAPI app: native /generate, OpenAI-compatible completions and chat, health, readiness, metrics.

    Guard (guard.py: request id, body limit, log line) -> routes (routes/native.py, routes/openai.py; the
    API key checked by a security dependency, context.py) -> jobs.py (request -> the served model's limits
    (limits.py) -> job on the orchestrator -> JSON or SSE)

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` (errors.py).
The request and response models are static; /openapi.json carries the loaded engines' limits (limits.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from .context import Server, ServerSettings, require_api_key
from .errors import ApiError, install_error_handlers
from .guard import Guard
from .routes import native, openai
from .routes.openai import chat_prompt_ids

if TYPE_CHECKING:
    from ..decoding import BatchDecoder

__all__ = ["ApiError", "Server", "ServerSettings", "chat_prompt_ids", "create_app"]


def create_app(
    decoder: BatchDecoder, settings: ServerSettings | None = None, clock: Callable[[], float] = time.monotonic
) -> FastAPI:
    """An app serving the engines and tokenizer of `decoder` (a BatchDecoder from `dflash_trt.loading`), on
    one serving decoder of its own (context.Server). The orchestrator runs for the app's lifespan; `clock` is
    the one its request timings read (deadlines, latencies, the stall)."""
    server = Server(decoder, settings or ServerSettings(), clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.orchestrator.start()
        server.started = True
        try:
            yield
        finally:
            server.started = False
            await run_in_threadpool(server.orchestrator.stop)

    app = FastAPI(
        title="dflash-trt",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=None,  # served below, behind the key like every route but the probes
        docs_url=None,
        redoc_url=None,
        description="DFlash speculative decoding server: native and OpenAI-compatible endpoints. "
        'Every error is a JSON body {"error": {"message", "type", "param", "code"}}.',
    )
    app.state.server = server
    # The key is checked on every router but the probes' (/health, /ready); without a key there is no dependency, so
    # /openapi.json declares a security scheme exactly when the server has one.
    auth = [Depends(require_api_key)] if server.settings.api_keys else []
    app.include_router(native.open_router)
    app.include_router(native.router, dependencies=auth)
    app.include_router(openai.router, dependencies=auth)
    app.include_router(_docs_router(app), dependencies=auth)
    app.add_middleware(Guard, server=server)
    install_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to replace it
    return app


def _docs_router(app: FastAPI) -> APIRouter:
    """/openapi.json and its Swagger UI (/docs), on a router, so that the API key guards them as it does
    every route but the probes (/health, /ready)."""
    router = APIRouter(include_in_schema=False)

    @router.get("/openapi.json")
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())

    @router.get("/docs")
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    return router


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with the served model's limits (limits.py), told the truth about validation
    errors: they are 400s with our error body (errors.py), not 422s with FastAPI's."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        app.state.server.limits.document(doc)
        for path in doc.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema
