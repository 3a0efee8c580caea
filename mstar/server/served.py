"""Which backend and model a request is for."""

from __future__ import annotations

from fastapi import Request

from mstar.server.backend import ServingBackend
from mstar.server.errors import APIError


def backend_of(request: Request) -> ServingBackend:
    return request.app.state.backend


def resolve_model(request: Request, requested: str | None) -> str:
    names: list[str] = request.app.state.model_names
    if requested is None:
        return names[0]
    if requested not in {*names, backend_of(request).model_id}:
        message = f"model: the model {requested!r} does not exist; served: {', '.join(names)}"
        raise APIError(404, message, "model", "model_not_found")
    return requested
