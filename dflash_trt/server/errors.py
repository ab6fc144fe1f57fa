"""Errors as OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`, for every failure:
our own (ApiError), pydantic's validation errors (400, not FastAPI's 422), Starlette's 404/405, the
orchestrator's refusals (a full queue 429, a draining server 503), a job's end (timeout, shutdown,
engine failure) and anything unexpected (500 with the request id).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ExceptionHandler

from .orchestrator import QueueFull, ShuttingDown
from .schemas import error_body

log = logging.getLogger("dflash_trt.server")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def job_error(kind: str, message: str) -> ApiError:
    """The error for a job that ended without a result (orchestrator.ErrorEvent kinds)."""
    if kind == "timeout":
        return ApiError(504, message, "timeout_error", code="timeout")
    if kind == "shutdown":
        return ApiError(503, message, "server_error", code="shutting_down")
    if kind == "cancelled":
        return ApiError(499, message, "server_error", code="cancelled")
    return ApiError(500, f"{message}; the server keeps serving", "server_error", code="engine_error")


def install_error_handlers(app: FastAPI) -> None:
    # Starlette types a handler for every exception; each of these gets only the class it is registered for
    app.add_exception_handler(ApiError, cast(ExceptionHandler, _api_error))
    app.add_exception_handler(RequestValidationError, cast(ExceptionHandler, _validation_error))
    app.add_exception_handler(StarletteHTTPException, cast(ExceptionHandler, _http_error))
    app.add_exception_handler(QueueFull, cast(ExceptionHandler, _queue_full))
    app.add_exception_handler(ShuttingDown, cast(ExceptionHandler, _shutting_down))
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


async def _queue_full(request: Request, exc: QueueFull) -> JSONResponse:
    message = f"server busy: {exc}; retry later"
    return error_response(429, message, "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


async def _shutting_down(request: Request, exc: ShuttingDown) -> JSONResponse:
    return error_response(503, str(exc), "server_error", code="shutting_down", headers={"Retry-After": "5"})


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        message = "malformed JSON body: " + str(errors[0].get("ctx", {}).get("error", "cannot parse"))
        return error_response(400, message, code="json_invalid")
    first = min(errors, key=_specificity) if errors else {}
    loc = _field_path(first.get("loc", ()))
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
        msg = "Unrecognized request argument supplied"
    message = f"{'.'.join(loc) or 'body'}: {msg}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return error_response(400, message, param=".".join(loc) or None, code=first.get("type"))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(
        exc.status_code,
        str(exc.detail),
        "invalid_request_error",
        code="not_found" if exc.status_code == 404 else None,
        headers=exc.headers,
    )


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    rid = request.scope.get("state", {}).get("request_id")
    log.error("request %s: unhandled %s", rid, type(exc).__name__, exc_info=exc)
    return error_response(500, f"internal error (request {rid})", "server_error")


def _specificity(error: dict[str, Any]) -> tuple[bool, int]:
    """Which of pydantic's errors to report: for a value that fits no member of a union (a prompt is text,
    a list of one text, or token ids) the member whose check got furthest, not "should be a valid string"."""
    return (error.get("type", "").endswith("_type"), -len(error.get("loc", ())))


def _field_path(loc: Sequence[int | str]) -> list[str]:
    """pydantic's error location without "body" and without its names for union members."""
    return [str(p) for p in loc if isinstance(p, int) or (p != "body" and _FIELD.fullmatch(p) and p not in _TAGS)]


_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}
