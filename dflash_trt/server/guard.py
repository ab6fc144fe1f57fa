"""The guard: a pure ASGI middleware that sees every request before routing and parsing.

It gives each request its id (`x-request-id`), enforces the body size limit (reading the body itself,
so a lying Content-Length cannot get past), and writes one JSON log line and one metrics sample per
request. The API key is a security dependency of the routers (context.require_api_key); a draining
server refuses new work where it is admitted (orchestrator.Orchestrator.check_admission).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

if TYPE_CHECKING:
    from .context import Server

log = logging.getLogger("dflash_trt.server")

# paths with their own label in dflash_requests_total (any other path counts as "other")
ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics")


class Guard:
    def __init__(self, app: ASGIApp, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.server
        settings = server.settings
        rid = uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        started = time.monotonic()
        status = [500]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        async def reply(response: Response) -> None:
            await response(scope, receive, send_with_id)

        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
                # We only speak JSON: parse the body as JSON whatever the client labelled it.
                scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
                scope["headers"].append((b"content-type", b"application/json"))
            declared = headers.get("content-length")
            if declared is not None and not declared.isdigit():
                return await reply(
                    error_response(400, f"Content-Length is not a byte count: {declared!r}", code="bad_http_request")
                )
            if declared is not None and int(declared) > settings.max_body_bytes:
                return await reply(_too_large(settings.max_body_bytes))
            body: list[bytes] = []
            more = True
            size = 0
            while more and scope["method"] in ("POST", "PUT", "PATCH"):
                message = await receive()
                if message["type"] == "http.disconnect":  # the client hung up mid-upload: not our error
                    status[0] = 499
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > settings.max_body_bytes:
                    return await reply(_too_large(settings.max_body_bytes))
                body.append(chunk)
                more = message.get("more_body", False)
            replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

            async def receive_replayed() -> Message:
                return replay.pop() if replay else await receive()

            await self.app(scope, receive_replayed, send_with_id)
        finally:
            server.metrics.requests.labels(endpoint, str(status[0])).inc()
            _log_request(rid, scope, status[0], time.monotonic() - started)


def _too_large(limit: int) -> Response:
    return error_response(413, f"request body larger than {limit} bytes", code="request_too_large")


def _log_request(rid: str, scope: Scope, status: int, latency: float) -> None:
    fields: dict[str, Any] = {
        "request_id": rid,
        "method": scope["method"],
        "path": scope["path"],
        "status": status,
        "latency_s": round(latency, 4),
    }
    job = scope.get("state", {}).get("job")
    if job is not None:
        s = job.row.stats
        fields.update(
            prompt_tokens=s.prompt_tokens,
            new_tokens=s.new_tokens,
            tau=round(s.mean_acceptance_length, 3),
            rounds=s.rounds,
            outcome=job.outcome or (job.cancelled.kind if job.cancelled else None),
            finish_reason=job.row.finish_reason,
            drafter_fallback=job.row.drafter_error is not None,
        )
    log.info(json.dumps(fields))
