"""The HTTP front end, assembled: ``create_app(backend)`` builds a FastAPI app over any
``ServingBackend`` from the route modules (chat, text completions, /generate, audio, speech,
images, videos, models and health, /metrics, the Realtime WebSocket, the browser playground at /) and
the shared plumbing they import (``errors``, ``streaming``, ``bodies``, ``served``). Every
route is there for every model; one the model cannot serve answers a 400 naming ``model`` (the
backend's ``tasks`` say what it serves; the WebSocket, an ``error`` event and a close). Every
error has OpenAI's body;
a backend that is full raises ``Overloaded`` (429 with Retry-After); routes that parse their
body by hand publish its schema in /openapi.json from the pydantic model that describes it.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request

from mstar import __version__
from mstar.server.audio_routes import audio_router
from mstar.server.backend import ServingBackend
from mstar.server.chat_routes import chat_completions
from mstar.server.completion_routes import CompletionRequest, completions
from mstar.server.errors import APIError, install_error_handlers
from mstar.server.generate_routes import generate
from mstar.server.generate_ws import generate_ws_route
from mstar.server.image_routes import image_router
from mstar.server.metrics import MetricsMiddleware, ServerMetrics, metrics_endpoint
from mstar.server.options import VideoJobOptions
from mstar.server.playground_routes import playground_router
from mstar.server.realtime import realtime_route
from mstar.server.schemas import (
    ChatCompletionRequest,
    GenerateForm,
    ModelList,
    form_body_openapi,
    json_body_openapi,
)
from mstar.server.served import model_aliases
from mstar.server.speech_routes import speech_router
from mstar.server.status_routes import health, list_models
from mstar.server.video_jobs import VideoJobs, video_jobs_router
from mstar.server.video_routes import video_router


def _require_api_key(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode()

    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        valid = secrets.compare_digest(token.strip().encode(), expected)
        if scheme.lower() != "bearer" or not valid:
            message = "missing or invalid API key (send 'Authorization: Bearer <key>')"
            raise APIError(401, message, None, "invalid_api_key")

    return check


def create_app(
    backend: ServingBackend,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    on_shutdown: Callable[[], None] | None = None,
    video_jobs: VideoJobOptions | None = None,
) -> FastAPI:
    """The HTTP app over ``backend``.

    ``served_model_names``: the names /v1/models lists and requests may use (default: the
    backend's ``model_id``, which is always accepted too). ``api_key``: if set, every route
    but /health and the playground's page and files needs ``Authorization: Bearer <api_key>``
    (/metrics included; the page holds no secrets and sends the key the user types).
    ``on_shutdown``: called (in a thread) when the ASGI server shuts the app down, e.g. to
    stop the workers: uvicorn re-raises SIGTERM once it has stopped, so code after
    ``uvicorn.run`` never runs then. ``video_jobs``: the bounds of OpenAI's /v1/videos job
    store (default ``VideoJobOptions()``).
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if on_shutdown is not None:
                await anyio.to_thread.run_sync(on_shutdown)

    app = FastAPI(title="M*", version=__version__, lifespan=lifespan)
    app.state.backend = backend
    app.state.metrics = ServerMetrics(backend)
    app.state.video_jobs = VideoJobs(video_jobs or VideoJobOptions())
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    # a many-model deployment also answers to its parts' own names, listed after its own
    app.state.model_names = list(dict.fromkeys([*(served_model_names or [backend.model_id]),
                                                *model_aliases(backend)]))
    install_error_handlers(app)

    router = APIRouter(dependencies=[Depends(_require_api_key(api_key))] if api_key else [])
    router.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList)
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                         openapi_extra=json_body_openapi(ChatCompletionRequest))
    router.add_api_route("/v1/completions", completions, methods=["POST"],
                         openapi_extra=json_body_openapi(CompletionRequest))
    router.add_api_route("/generate", generate, methods=["POST"], openapi_extra=form_body_openapi(
        GenerateForm, {"files": True}, urlencoded=True))
    router.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    # Every route is mounted whatever the model: one it cannot serve answers a 400 naming
    # ``model`` (see ``resolve_model``) before the backend's task method is called.
    router.include_router(audio_router(backend))  # type: ignore[arg-type]
    router.include_router(speech_router(backend))  # type: ignore[arg-type]
    router.include_router(image_router(backend))  # type: ignore[arg-type]
    router.include_router(video_router())
    router.include_router(video_jobs_router())
    app.include_router(router)
    # a WebSocket route checks the key and the model itself, so that a refused client is told why
    app.add_api_websocket_route("/v1/realtime", realtime_route(backend, api_key))  # type: ignore[arg-type]
    app.add_api_websocket_route("/generate/ws", generate_ws_route(api_key))
    app.add_api_route("/health", health, methods=["GET"])
    app.include_router(playground_router())
    return app
