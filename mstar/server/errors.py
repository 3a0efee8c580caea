"""How the API answers errors: OpenAI's body ``{"error": {"message", "type", "param", "code"}}``
with the field named as a path (``messages[0].content[1]``), the status a failure maps to,
and the same object sent in band once a stream has started."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar.contract import OutputEvent, Overloaded, RequestError
from mstar.server.schemas import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

_LOC_ROOTS = {"body", "query", "path", "header", "cookie"}
_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An HTTP error raised by the app itself (unknown model, bad API key, ...)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class BackendFailure(Exception):
    """The backend reported a failure through an event (``error`` or finish "error")."""

    def __init__(self, message: str, status: int = 500, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param

    @classmethod
    def of(cls, event: OutputEvent, default: str = "the backend failed to complete the request") -> BackendFailure:
        return cls(event.error or default, event.error_status or 500, event.error_field)


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _param_of(loc: Sequence[Any]) -> str | None:
    """A pydantic ``loc`` as a path: ``("body", "messages", 0, "role")`` -> ``messages[0].role``."""
    parts = list(loc)
    if parts and parts[0] in _LOC_ROOTS:
        parts = parts[1:]
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None


def validation_error_response(errors: Sequence[Any]) -> JSONResponse:
    """A 400 naming the first offending field; the message lists the violated rules."""
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return error_response(400, f"malformed JSON body: {reason}", "body", "invalid_json")
    rules = []
    for err in errors[:8]:
        param = _param_of(err.get("loc", ()))
        rules.append(f"{param}: {err.get('msg')}" if param else str(err.get("msg")))
    return error_response(400, "; ".join(rules), _param_of(first.get("loc", ())), "invalid_value")


def exception_response(exc: BaseException) -> JSONResponse:
    """The response for an exception: its own status for RequestError/APIError, a failed
    request's status for BackendFailure (500 unless it says otherwise), else 500."""
    if isinstance(exc, Overloaded):
        response = error_response(429, exc.message, None, "queue_full")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response
    if isinstance(exc, RequestError):
        message = f"{exc.field}: {exc.message}" if exc.field else exc.message
        return error_response(exc.status, message, exc.field)
    if isinstance(exc, APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)
    if isinstance(exc, BackendFailure) and exc.status != 500:
        return error_response(exc.status, str(exc), exc.param)
    if not isinstance(exc, BackendFailure):
        log.error("request failed", exc_info=exc)
    return error_response(500, f"internal error: {exc}" if str(exc) else "internal error")


def in_band_error(exc: BaseException) -> dict:
    """The ``{"error": ...}`` object sent inside a stream that has already started."""
    return json.loads(bytes(exception_response(exc).body))


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        return validation_error_response(exc.errors())

    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    async def on_other(_: Request, exc: Exception) -> Response:
        return exception_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    for kind in (APIError, RequestError, Exception):
        app.add_exception_handler(kind, on_other)
