"""``GET /v1/models`` and ``GET /health``."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mstar.contract import TASKS
from mstar.server.errors import error_response
from mstar.server.schemas import ModelCard, ModelList
from mstar.server.served import backend_of, model_aliases

log = logging.getLogger(__name__)


async def list_models(request: Request) -> ModelList:
    backend = backend_of(request)
    aliases = model_aliases(backend)  # a many-model deployment's parts serve their own tasks

    def card(name: str) -> ModelCard:
        serves = aliases.get(name, backend.tasks)
        tasks = [task for task in TASKS if task in serves]  # in the contract's order
        return ModelCard(id=name, max_model_len=backend.max_model_len, tasks=tasks)

    names: list[str] = request.app.state.model_names
    return ModelList(data=[card(name) for name in names])


async def health(request: Request) -> Response:
    """200 while the backend serves; 503 naming the failure (e.g. the dead worker) after."""
    backend = backend_of(request)
    replicas = None
    try:
        ok = bool(backend.healthy())
        failure = getattr(backend, "failure", None) if not ok else None
        replica_health = getattr(backend, "replica_health", None)
        replicas = replica_health() if replica_health is not None else None
    except Exception as exc:
        log.exception("backend health check failed")
        ok, failure = False, f"the health check failed: {exc}"
    if not ok:
        response = error_response(503, f"the backend is not healthy: {failure}" if failure
                                  else "the backend is not healthy")
        if replicas is not None:  # which replicas still serve
            body = json.loads(response.body)
            body["replicas"] = replicas
            return JSONResponse(body, status_code=503)
        return response
    return JSONResponse({"status": "ok"} | ({"replicas": replicas} if replicas is not None else {}))
