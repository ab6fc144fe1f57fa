"""The FastAPI app: native /generate, OpenAI-compatible completions and chat, health, readiness, metrics.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`. A guard
in front of the routes does what must happen before any parsing: request ids, the body size
limit, bearer-token auth, refusing new work while draining, one JSON log line per request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding import ContextLengthError, GenerationConfig, GenerationResult, InputError, SamplingParams
from ..decoding import prompting
from .metrics import ServerMetrics
from .scheduler import ErrorEvent, Job, Orchestrator, QueueFull, RoundEvent, ShuttingDown
from .schemas import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, GenerateRequest,
                      error_body, stop_tuple)
from .tokenizer import with_serialized_tokenizer

log = logging.getLogger("dflash_trt.server")

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics")
OPEN_PATHS = ("/health",)  # reachable without the API key
DRAIN_OPEN_PATHS = ("/health", "/metrics")  # still answered while draining


@dataclass
class ServerSettings:
    api_key: str | None = None
    model_name: str = "dflash-trt"
    max_active: int = 8  # generations advanced concurrently (each holds its own KV caches)
    max_queue: int = 64  # waiting requests beyond max_active; more get 429
    request_timeout_s: float = 300.0
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256  # chat requests without max_tokens (clipped to the context)
    # (completions without max_tokens get OpenAI's 16, /generate its documented 128)
    drain_timeout_s: float = 30.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


def _error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                    headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


# ---- the guard (pure ASGI, so it sees every request before routing and parsing) ---------------
class Guard:
    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.server
        settings: ServerSettings = server.settings
        rid = uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        started = time.monotonic()
        status = [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        async def reply(response: Response):
            await response(scope, receive, send_with_id)

        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if settings.api_key and path not in OPEN_PATHS and not _authorized(headers, settings.api_key):
                return await reply(_error_response(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            if server.orchestrator.draining and path not in DRAIN_OPEN_PATHS:
                return await reply(_error_response(503, "the server is shutting down", "server_error",
                                                   code="shutting_down", headers={"Retry-After": "5"}))
            if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
                # We only speak JSON: parse the body as JSON whatever the client labelled it.
                scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
                scope["headers"].append((b"content-type", b"application/json"))
            declared = headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > settings.max_body_bytes):
                return await reply(_too_large(settings))
            body, more = [], True
            size = 0
            while more and scope["method"] in ("POST", "PUT", "PATCH"):
                message = await receive()
                if message["type"] == "http.disconnect":  # the client hung up mid-upload: not our error
                    status[0] = 499
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > settings.max_body_bytes:
                    return await reply(_too_large(settings))
                body.append(chunk)
                more = message.get("more_body", False)
            replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

            async def receive_replayed():
                return replay.pop() if replay else await receive()

            await self.app(scope, receive_replayed, send_with_id)
        finally:
            server.metrics.requests.labels(endpoint, str(status[0])).inc()
            _log_request(rid, scope, status[0], time.monotonic() - started)


def _too_large(settings: ServerSettings) -> JSONResponse:
    return _error_response(413, f"request body larger than {settings.max_body_bytes} bytes",
                           code="request_too_large")


def _authorized(headers: dict, key: str) -> bool:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _log_request(rid: str, scope, status: int, latency: float) -> None:
    fields = {"request_id": rid, "method": scope["method"], "path": scope["path"], "status": status,
              "latency_s": round(latency, 4)}
    job: Job | None = scope.get("state", {}).get("job")
    if job is not None:
        s = job.generation.stats
        fields.update(prompt_tokens=s.prompt_tokens, new_tokens=s.new_tokens,
                      tau=round(s.mean_acceptance_length, 3), rounds=s.rounds,
                      outcome=job.outcome or (job.cancelled.kind if job.cancelled else None),
                      finish_reason=job.generation.finish_reason,
                      drafter_fallback=job.generation.drafter_error is not None)
    log.info(json.dumps(fields))


# ---- the app --------------------------------------------------------------------------------
class Server:
    """What the routes share: the decoder, the orchestrator, the metrics, the settings."""

    def __init__(self, decoder, settings: ServerSettings):
        self.decoder, self.settings = with_serialized_tokenizer(decoder), settings
        self.metrics = ServerMetrics()
        self.orchestrator = Orchestrator(self.decoder, self.metrics, settings.max_active, settings.max_queue)
        self.started = False


def create_app(decoder, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `decoder` (a SpeculativeDecoder). The orchestrator runs for the app's lifespan."""
    settings = settings or ServerSettings()
    server = Server(decoder, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.orchestrator.start()
        server.started = True
        try:
            yield
        finally:
            server.started = False
            await run_in_threadpool(server.orchestrator.stop)

    app = FastAPI(title="dflash-trt", version="0.1.0", lifespan=lifespan,
                  description="DFlash speculative decoding server: native and OpenAI-compatible endpoints.")
    app.state.server = server
    app.add_middleware(Guard, server=server)
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = "malformed JSON body: " + str(first.get("ctx", {}).get("error", "cannot parse"))
            loc = []
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more problems)"
        return _error_response(400, message, param=".".join(loc) or None, code=first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail), "invalid_request_error",
                               code="not_found" if exc.status_code == 404 else None, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        rid = request.scope.get("state", {}).get("request_id")
        log.error("request %s: unhandled %s", rid, type(exc).__name__, exc_info=exc)
        return _error_response(500, f"internal error (request {rid})", "server_error")


# ---- requests -> jobs -----------------------------------------------------------------------
def _config(server: Server, req, max_tokens: int, block_size: int | None = None) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_tokens,
        sampling=SamplingParams(req.temperature, req.top_p, req.top_k, req.seed),
        block_size=block_size,
        stop_token_ids=server.decoder.default_stop_ids(),
        stop_strings=stop_tuple(req.stop),
        drafter_fallback=True,
    )


async def _start_job(request: Request, server: Server, make_prompt, make_config) -> Job:
    """Tokenize, validate against the engines, enqueue. Input problems are 400s; a full queue is 429.

    No engine lock: decoder.start() only validates and makes new, empty sessions; only the
    orchestrator's worker runs the engines. A full queue answers before any tokenizing."""
    decoder, orch = server.decoder, server.orchestrator

    def prepare():
        ids = make_prompt()
        return decoder.start(ids, make_config(len(ids)))

    try:
        orch.check_admission()
        generation = await run_in_threadpool(prepare)
        job = Job(id=request.state.request_id, generation=generation, loop=asyncio.get_running_loop(),
                  deadline=time.monotonic() + server.settings.request_timeout_s)
        orch.submit(job)
    except ContextLengthError as e:
        raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
    except (InputError, ValueError) as e:
        raise ApiError(400, str(e)) from None
    except QueueFull as e:
        raise ApiError(429, f"server busy: {e}; retry later", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except ShuttingDown as e:
        raise ApiError(503, str(e), "server_error", code="shutting_down", headers={"Retry-After": "5"}) from None
    request.state.job = job
    return job


def _api_error_for(event: ErrorEvent, job: Job) -> ApiError:
    if event.kind == "timeout":
        return ApiError(504, event.message, "timeout_error", code="timeout")
    if event.kind == "shutdown":
        return ApiError(503, event.message, "server_error", code="shutting_down")
    if event.kind == "cancelled":
        return ApiError(499, event.message, "server_error", code="cancelled")
    return ApiError(500, f"{event.message}; the server keeps serving", "server_error", code="engine_error")


async def _wait_result(request: Request, job: Job) -> GenerationResult:
    """Wait for the job's last round; a client that hangs up cancels it."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                continue
            if isinstance(event, ErrorEvent):
                raise _api_error_for(event, job)
            if event.result is not None:
                return event.result
    finally:
        job.cancel()  # no-op when finished; frees the slot when this handler is cancelled


class JobStream(StreamingResponse):
    """A streaming response that cancels its job however the response ends (disconnect included)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _stream(job: Job, on_round, on_error, done_marker: bool) -> JobStream:
    """SSE: on_round(RoundEvent) gives the chunks of a round (the last round carries the result)."""

    async def events():
        while True:
            event = await job.events.get()
            if isinstance(event, ErrorEvent):
                yield _sse(on_error(_api_error_for(event, job)))
                break
            for chunk in on_round(event):
                yield _sse(chunk)
            if event.result is not None:
                break
        if done_marker:
            yield _sse("[DONE]")

    return JobStream(events(), job)


def _usage(result_or_gen) -> dict:
    s = result_or_gen.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
            "total_tokens": s.prompt_tokens + s.new_tokens}


def _spec(job: Job) -> dict:
    d = job.generation.stats.to_dict()
    d["drafter_fallback"] = job.generation.drafter_error is not None
    return d


# ---- routes ---------------------------------------------------------------------------------
def _add_routes(app: FastAPI, server: Server) -> None:
    decoder, settings = server.decoder, server.settings
    max_context = decoder.target.max_context

    def _max_tokens(asked: int | None, default: int, prompt_len: int) -> int:
        """What the client asked for (too much is a 400), else the default clipped to the context left."""
        return asked or max(1, min(default, max_context - prompt_len))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not server.started:
            return _error_response(503, "engines not loaded", "server_error", code="not_ready")
        return {"status": "ready", "model": settings.model_name, "drafter": decoder.drafter is not None}

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "dflash-trt",
             "max_model_len": max_context}]}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        job = await _start_job(
            request, server,
            lambda: decoder.encode(body.prompt) if body.prompt is not None else list(body.input_ids),
            lambda n: _config(server, body, body.max_tokens, body.block_size))

        def final(result: GenerationResult) -> dict:
            return {"id": job.id, "text": result.text, "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason, "usage": _usage(result), "spec": _spec(job)}

        if not body.stream:
            return final(await _wait_result(request, job))

        def on_round(event: RoundEvent):
            r = event.round
            yield {"type": "round", "token_ids": r.token_ids, "text": event.text, "accepted": r.accepted,
                   "drafted": r.drafted, "prefill": r.prefill}
            if event.result is not None:
                yield {"type": "final", **final(event.result)}

        return _stream(job, on_round, lambda err: {"type": "error", **err.body}, done_marker=False)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        job = await _start_job(
            request, server,
            lambda: decoder.encode(prompt) if isinstance(prompt, str) else list(prompt),
            lambda n: _config(server, body, _max_tokens(body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, n)))
        created, cid = int(time.time()), f"cmpl-{job.id}"

        def choice(text, finish_reason, token_ids=None):
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            if decoder.tokenizer is None and token_ids is not None:
                c["token_ids"] = token_ids  # no tokenizer: the ids are the only output
            return c

        def envelope(choices, **extra):
            return {"id": cid, "object": "text_completion", "created": created, "model": settings.model_name,
                    "choices": choices, **extra}

        if not body.stream:
            result = await _wait_result(request, job)
            return envelope([choice(result.text, result.finish_reason, result.token_ids)],
                            usage=_usage(result), spec=_spec(job))

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def on_round(event: RoundEvent):
            result = event.result
            yield envelope([choice(event.text, result.finish_reason if result else None, event.round.token_ids)])
            if result is not None and include_usage:
                yield envelope([], usage=_usage(result))

        return _stream(job, on_round, lambda err: err.body, done_marker=True)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        messages = [{"role": m.role, "content": m.content or ""} for m in body.messages]

        asked = body.max_completion_tokens or body.max_tokens
        job = await _start_job(request, server, lambda: chat_prompt_ids(decoder, messages),
                               lambda n: _config(server, body, _max_tokens(asked, settings.default_max_tokens, n)))
        created, cid = int(time.time()), f"chatcmpl-{job.id}"

        def envelope(choices, obj="chat.completion", **extra):
            return {"id": cid, "object": obj, "created": created, "model": settings.model_name,
                    "choices": choices, **extra}

        if not body.stream:
            result = await _wait_result(request, job)
            message = {"role": "assistant", "content": result.text}
            return envelope([{"index": 0, "message": message, "logprobs": None,
                              "finish_reason": result.finish_reason}], usage=_usage(result), spec=_spec(job))

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def on_round(event: RoundEvent):
            delta = {"content": event.text or ""}
            if event.round.prefill:
                delta["role"] = "assistant"
            yield envelope([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                           "chat.completion.chunk")
            if event.result is not None:
                yield envelope([{"index": 0, "delta": {}, "logprobs": None,
                                 "finish_reason": event.result.finish_reason}], "chat.completion.chunk")
                if include_usage:
                    yield envelope([], "chat.completion.chunk", usage=_usage(event.result))

        return _stream(job, on_round, lambda err: err.body, done_marker=True)


def chat_prompt_ids(decoder, messages: list[dict]) -> list[int]:
    """The tokenizer's chat template when it has one; otherwise `role: content` lines then `assistant:`
    (dflash_trt.decoding.prompting, shared with the Triton preprocessing model)."""
    tok = decoder.tokenizer
    if tok is None:
        raise InputError("chat needs a tokenizer; this target has none (use /v1/completions with token ids)")
    return prompting.chat_prompt_ids(tok, messages)
