"""Our own API: POST /generate (JSON or one SSE event per verified round), /health, /ready, /metrics.

`open_router` (/health, /ready) answers without the API key and while draining: Kubernetes' httpGet probes send
no credentials (a probe's `httpHeaders` would put the key in the pod spec, readable by anyone who can read pods),
so a probe behind the key gets 401, which counts as a failure, and no pod ever becomes Ready. They reveal
only liveness, readiness and the served model's name. `router` gets the key check from create_app; /metrics is on
it, and Prometheus scrapes it with the key (deploy/k8s/base/servicemonitor.yaml: `authorization`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...decoding import GenerationResult
from .. import structured
from ..context import Server, ServerDep
from ..errors import error_response
from ..jobs import JobStream, generation_config, spec, start_job, stream, usage, wait_result
from ..orchestrator import Job, RoundEvent
from ..responses import GenerateResponse, Health, Ready, errors, streamed
from ..schemas import GenerateRequest

open_router = APIRouter()
router = APIRouter()


@open_router.get(
    "/health",
    response_model=Health,
    responses=errors(503),
    summary="alive (answers even without the API key and while draining); 503 when decoding stalled",
)
async def health(server: ServerDep) -> dict[str, str] | JSONResponse:
    limit, stalled = server.settings.health_stall_s, server.orchestrator.stalled_for()
    if limit > 0 and stalled > limit:
        return error_response(
            503, f"no decoding step ended for {stalled:.0f} s while requests wait", "server_error", code="stalled"
        )
    return {"status": "ok"}


@open_router.get(
    "/ready",
    response_model=Ready,
    responses=errors(503),
    summary="engines loaded and not draining (answers without the API key: the readiness probe sends none)",
)
async def ready(server: ServerDep) -> dict[str, Any] | JSONResponse:
    if not server.started:
        return error_response(503, "engines not loaded", "server_error", code="not_ready")
    server.orchestrator.check_open()  # draining: 503 shutting_down
    return {"status": "ready", "model": server.settings.model_name, "drafter": server.decoder.drafter is not None}


@router.get(
    "/metrics",
    summary="Prometheus metrics (answered while draining; needs the API key when the server has one)",
    response_model=None,  # what FastAPI infers without a return annotation
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
        **errors(401),
    },
)
async def metrics(server: ServerDep) -> Response:
    body, content_type = server.metrics.render()
    return Response(body, media_type=content_type)


@router.post(
    "/generate",
    summary="generate from text or token ids",
    response_model=GenerateResponse,
    response_model_exclude_unset=True,
    responses=streamed(
        GenerateResponse,
        "the result; with stream: one `round` event per verified round, then a `final` event (or an `error` event)",
        400,
        401,
        413,
        429,
        500,
        503,
        504,
    ),
)
async def generate(body: GenerateRequest, request: Request, server: ServerDep) -> dict[str, Any] | JobStream:
    decoder = server.decoder
    grammar = structured.request_grammar(body)
    job = await start_job(
        request,
        server,
        body,
        lambda: decoder.encode(body.prompt) if body.prompt is not None else list(body.input_ids),
        lambda n: generation_config(
            server, body, body.max_tokens, body.temperature, body.prompt is not None, grammar, body.logprobs
        ),
        prompt_param="prompt" if body.prompt is not None else "input_ids",
    )
    if not body.stream:
        return _final(server, job, await wait_result(request, job), body.logprobs is not None)

    def on_round(event: RoundEvent) -> Iterator[dict[str, Any]]:
        rnd = event.round
        out: dict[str, Any] = {
            "type": "round",
            "token_ids": rnd.token_ids,
            "text": event.round.text,
            "accepted": rnd.accepted,
            "drafted": rnd.drafted,
            "prefill": rnd.prefill,
        }
        if body.logprobs is not None:
            out["logprobs"] = structured.native_logprobs(rnd.logprobs or [])
        yield out
        if event.result is not None:
            yield {"type": "final", **_final(server, job, event.result, body.logprobs is not None)}

    return stream(job, on_round, lambda err: {"type": "error", **err.body}, done_marker=False)


def _final(server: Server, job: Job, result: GenerationResult, logprobs: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": job.id,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "usage": usage(result),
        "spec": spec(job, server.drafter_dtype),
    }
    if logprobs:
        out["logprobs"] = structured.native_logprobs(result.logprobs or [])
    return out
