"""The SDK's error: what the server answered (or that it could not be reached)."""

from __future__ import annotations

from typing import Any

import httpx


class MStarError(Exception):
    """An error from the server (``status`` is its HTTP status; 0: no response at all)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message
        self.param = param


def _error_of(status: int, body: Any) -> MStarError:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return MStarError(status, str(err.get("message", "")), err.get("param"))
    return MStarError(status, str(body))


_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
}


def in_band_error(body: dict) -> MStarError:
    """An error the server sent inside a stream that had already started."""
    err = body.get("error")
    kind = err.get("type") if isinstance(err, dict) else None
    return _error_of(_STATUS_OF_TYPE.get(str(kind), 500), body)


def raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    response.read()
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise _error_of(response.status_code, body)
