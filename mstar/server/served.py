"""Which backend and model a request is for, and whether that model serves the request."""

from __future__ import annotations

from starlette.requests import HTTPConnection

from mstar.server.backend import ServingBackend
from mstar.server.errors import APIError


def backend_of(request: HTTPConnection) -> ServingBackend:
    return request.app.state.backend


def resolve_model(request: HTTPConnection, requested: str | None, task: str | None = None) -> str:
    """The name the request (or WebSocket) is served under (``requested``, else the first served name).
    A name not served is a 404; a model that cannot do ``task`` (of ``mstar.contract.TASKS``;
    None: a route every model serves) is a 400 naming ``model``, before the model sees it."""
    names: list[str] = request.app.state.model_names
    backend = backend_of(request)
    name = names[0] if requested is None else requested
    if requested is not None and requested not in {*names, backend.model_id}:
        message = f"model: the model {requested!r} does not exist; served: {', '.join(names)}"
        raise APIError(404, message, "model", "model_not_found")
    tasks = model_aliases(backend).get(name, backend.tasks)
    if task is not None and task not in tasks:
        serves = ", ".join(sorted(tasks)) or "nothing but /generate"
        raise APIError(400, f"model: {name!r} does not serve {task}; it serves {serves}", "model",
                       "model_not_supported")
    return name


def model_aliases(backend: ServingBackend) -> dict[str, frozenset[str]]:
    """The models of a many-model deployment by their own names, with the tasks each serves
    there (a request may name ``smollm2`` on a ``voice_agent`` server); empty for one model."""
    return dict(getattr(backend, "model_aliases", None) or {})


def default_generate_outputs(backend: ServingBackend) -> tuple[str, ...]:
    """What a /generate request that leaves ``output_modalities`` out gets: the model spec's
    ``default_generate_outputs``, else text."""
    return tuple(getattr(getattr(backend, "spec", None), "default_generate_outputs", None) or ("text",))


def output_modalities(backend: ServingBackend) -> frozenset[str]:
    """What the served model's chat answer may be made of: the backend's
    ``output_modalities``, else its model spec's (the runtime's backend), else text only.
    With ``audio`` there, the backend speaks its answer (``sample_rate``, ``voices()``)."""
    declared = getattr(backend, "output_modalities", None)
    if declared is None:
        declared = getattr(getattr(backend, "spec", None), "output_modalities", None)
    return frozenset(declared or ("text",))
