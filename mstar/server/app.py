"""The HTTP front end: OpenAI-compatible chat completions, model list, health, /generate,
/metrics.

``create_app(backend)`` builds a FastAPI app over any ``ServingBackend``. Every error has
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``. However a request ends
(finished, failed, client gone), the backend's event iterator is closed: that is how the
backend learns to cancel a request. A backend that is full raises ``Overloaded`` (429
with Retry-After); an error event carries its status (504 timed out, 503 worker died).
Bodies are read through a byte cap (``capped_body``, ``capped_form``) before any of them is
decoded; media named by reference (chat's ``image_url`` / ``video_url`` parts, /generate's
``media``) go through ``mstar.media.fetch``, concurrently, before the backend sees the
request. Routes that parse their body by hand publish its schema in /openapi.json from the
pydantic model that describes it. A field is named as a path: ``messages[0].content[1]``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from mstar import __version__
from mstar.media.fetch import fetch_media
from mstar.server.backend import GenerateSpec, OutputEvent, Overloaded, RequestError, ServingBackend
from mstar.server.metrics import MetricsMiddleware, ServerMetrics, metrics_endpoint, observe_first_output
from mstar.server.schemas import (
    ChatCompletionRequest,
    ErrorDetail,
    ErrorResponse,
    GenerateForm,
    ModelCard,
    ModelList,
    Usage,
    form_body_openapi,
    json_body_openapi,
    new_id,
    parse_model_kwargs,
    parse_output_modalities,
)

log = logging.getLogger(__name__)

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_LOC_ROOTS = {"body", "query", "path", "header", "cookie"}
_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}

Events = AsyncIterator[OutputEvent]

MAX_GENERATE_FILES = 16  # files and media references per /generate request
MAX_GENERATE_FILE_BYTES = 64 * 1024 * 1024  # per input, checked before anything decodes it
_FORM_OVERHEAD = 1024 * 1024  # room for the text fields and the multipart framing

# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    """An HTTP error raised by the app itself (unknown model, bad API key, ...)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class BackendFailure(Exception):
    """The backend reported a failure through an event (``error`` or finish "error")."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status

    @classmethod
    def of(cls, event: OutputEvent, default: str = "the backend failed to complete the request") -> BackendFailure:
        return cls(event.error or default, event.error_status or 500)


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
        return error_response(exc.status, str(exc))
    if not isinstance(exc, BackendFailure):
        log.error("request failed", exc_info=exc)
    return error_response(500, f"internal error: {exc}" if str(exc) else "internal error")


def _in_band_error(exc: BaseException) -> dict:
    """The ``{"error": ...}`` object sent inside a stream that has already started."""
    return json.loads(bytes(exception_response(exc).body))


def _install_error_handlers(app: FastAPI) -> None:
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


# ------------------------------------------------------------------ backend iterators


async def _next(events: Events) -> OutputEvent | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _aclose(events: Events) -> None:
    """Close the backend's iterator (cancelling its request), even inside a cancelled scope."""
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:  # a backend failing to clean up must not break the response
            log.exception("closing the backend's event iterator failed")


@dataclass
class Tally:
    """What a request produced so far. Token counts in events are running totals."""

    text: list[str] = field(default_factory=list)
    data: dict[str, bytearray] = field(default_factory=dict)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_tokens: int = 0  # fallback when the backend leaves completion_tokens at 0

    def add(self, event: OutputEvent) -> None:
        self.prompt_tokens = max(self.prompt_tokens, event.prompt_tokens)
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        self.counted_tokens += len(event.token_ids)
        if event.text:
            self.text.append(event.text)
        if event.data is not None:
            self.data.setdefault(event.modality, bytearray()).extend(event.data)
        self.finish_reason = event.finish_reason or self.finish_reason

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens or self.counted_tokens)


async def _start(
    open_events: Callable[[], Events], request: Request | None = None
) -> tuple[OutputEvent | None, Events]:
    """Open the backend's stream and take its first event, so that a RequestError raised
    on the first advance, or a first event that is an error (a timeout in the queue, a
    dead worker), still becomes a plain HTTP error, before any stream starts."""
    events = open_events()
    try:
        first = await _next(events)
        if first is not None and (first.error or first.finish_reason == "error"):
            raise BackendFailure.of(first)
    except BaseException:
        await _aclose(events)
        raise
    if request is not None and first is not None:
        observe_first_output(request)
    return first, events


async def _walk(first: OutputEvent | None, events: Events, tally: Tally) -> Events:
    """The backend's events from ``first`` on, added to ``tally``. Stops after the event
    with a finish_reason, raises BackendFailure on an error event, always closes ``events``."""
    try:
        event = first
        while event is not None:
            if event.error or event.finish_reason == "error":
                raise BackendFailure.of(event)
            tally.add(event)
            yield event
            if event.finish_reason:
                return
            event = await _next(events)
    finally:
        await _aclose(events)


async def _collect(first: OutputEvent | None, events: Events) -> Tally:
    tally = Tally()
    async with aclosing(_walk(first, events, tally)) as walk:
        async for _ in walk:
            pass
    tally.finish_reason = tally.finish_reason or "stop"
    return tally


async def _unless_disconnected(
    request: Request, work: Callable[[], Awaitable[Response]]
) -> Response:
    """Run ``work``, cancelling it if the client disconnects first (the request body must
    have been read). Cancelling closes the backend's iterator (``_walk``'s finally)."""
    result = error_response(499, "client closed the request")

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client disconnected; cancelling the request")
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        result = await work()
        tg.cancel_scope.cancel()
    return result


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator when it is done, whatever
    the ASGI server's disconnect handling (so the generator's finally runs now, not at GC)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def _stream(body: AsyncIterator[str], media_type: str) -> Response:
    return _ClosingStreamingResponse(body, media_type=media_type, headers=_STREAM_HEADERS)


# ---------------------------------------------------------------------------- routes


def _backend(request: Request) -> ServingBackend:
    return request.app.state.backend


def _resolve_model(request: Request, requested: str | None) -> str:
    names: list[str] = request.app.state.model_names
    if requested is None:
        return names[0]
    if requested not in {*names, _backend(request).model_id}:
        message = f"model: the model {requested!r} does not exist; served: {', '.join(names)}"
        raise APIError(404, message, "model", "model_not_found")
    return requested


async def list_models(request: Request) -> ModelList:
    max_len = _backend(request).max_model_len
    names: list[str] = request.app.state.model_names
    return ModelList(data=[ModelCard(id=name, max_model_len=max_len) for name in names])


async def health(request: Request) -> Response:
    """200 while the backend serves; 503 naming the failure (e.g. the dead worker) after."""
    backend = _backend(request)
    try:
        ok = bool(backend.healthy())
        failure = getattr(backend, "failure", None) if not ok else None
    except Exception as exc:
        log.exception("backend health check failed")
        ok, failure = False, f"the health check failed: {exc}"
    if not ok:
        return error_response(503, f"the backend is not healthy: {failure}" if failure
                              else "the backend is not healthy")
    return JSONResponse({"status": "ok"})


async def capped_body(request: Request, *, max_bytes: int, field: str = "body") -> bytes:
    """The request body, refused with a 413 naming ``field`` as soon as it is declared or
    streamed past ``max_bytes``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(field, f"the request is {declared} bytes; the limit is {max_bytes} bytes", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestError(field, f"the request is over the limit of {max_bytes} bytes", 413)
    return bytes(body)


async def fetch_all(refs: Sequence[tuple[str, str, int]]) -> list[bytes]:
    """Each ``(ref, field, max_bytes)`` resolved by ``fetch_media``, all at once, in order.
    The first refusal is raised and the fetches still running are cancelled."""
    tasks = [asyncio.ensure_future(fetch_media(ref, max_bytes=cap, field=name)) for ref, name, cap in refs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for those that finished


@asynccontextmanager
async def capped_form(request: Request, *, max_bytes: int, field: str, max_files: int) -> AsyncIterator[FormData]:
    """The request's form (multipart or urlencoded), read through a byte counter: a body
    declared or streamed past ``max_bytes`` is a 413 naming ``field`` before any part of it
    is decoded; a malformed body is a 400 naming ``field``. Uploads are closed afterwards."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(field, f"the request is {declared} bytes; the limit is {max_bytes} bytes", 413)
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise RequestError(field, f"the request is over the limit of {max_bytes} bytes", 413)
        return message

    try:
        form = await Request(request.scope, receive).form(max_files=max_files)
    except StarletteHTTPException as exc:  # a malformed multipart body
        raise RequestError(field, str(exc.detail), exc.status_code) from None
    try:
        yield form
    finally:
        await form.close()


async def _generate_inputs(form: FormData) -> list[tuple[str, bytes]]:
    """The uploaded ``files``, each read at most one byte past the cap, then the ``media``
    references resolved, all at once (data URI, base64, or http(s) when allowed)."""
    uploads = form.getlist("files")
    refs = form.getlist("media")
    if len(uploads) + len(refs) > MAX_GENERATE_FILES:
        raise RequestError("files", f"at most {MAX_GENERATE_FILES} inputs (files and media), "
                                    f"got {len(uploads) + len(refs)}")
    inputs: list[tuple[str, bytes]] = []
    for i, upload in enumerate(uploads):
        if not isinstance(upload, UploadFile):
            raise RequestError(f"files.{i}", "must be a file part, not a text field")
        data = await upload.read(MAX_GENERATE_FILE_BYTES + 1)
        if len(data) > MAX_GENERATE_FILE_BYTES:
            raise RequestError(f"files.{i}", f"{upload.filename or 'the file'} is over the limit of "
                                             f"{MAX_GENERATE_FILE_BYTES} bytes", 413)
        inputs.append((upload.filename or f"file{i}", data))
    for i, ref in enumerate(refs):
        if not isinstance(ref, str):
            raise RequestError(f"media.{i}", "must be a text field (a data URI, base64 or URL), not a file")
    fetched = await fetch_all([(ref, f"media.{i}", MAX_GENERATE_FILE_BYTES) for i, ref in enumerate(refs)])
    return inputs + [(f"media{i}", data) for i, data in enumerate(fetched)]


async def _generate_spec(request: Request) -> tuple[GenerateSpec, bool]:
    limit = MAX_GENERATE_FILES * MAX_GENERATE_FILE_BYTES + _FORM_OVERHEAD
    async with capped_form(request, max_bytes=limit, field="files", max_files=MAX_GENERATE_FILES) as form:
        fields = {name: form.get(name) for name in ("text", "output_modalities", "streaming", "model_kwargs")}
        for name, value in fields.items():
            if value is not None and not isinstance(value, str):
                raise RequestError(name, "must be a text field, not a file")
        req = GenerateForm.model_validate({k: v for k, v in fields.items() if v is not None})
        files = await _generate_inputs(form)
    spec = GenerateSpec(
        request_id=new_id("gen"),
        text=req.text,
        files=files,
        output_modalities=parse_output_modalities(req.output_modalities),
        model_kwargs=parse_model_kwargs(req.model_kwargs),
    )
    return spec, req.streaming


async def generate(request: Request) -> Response:
    """Native multimodal endpoint (multipart form); a JSON result or NDJSON events."""
    try:
        spec, streaming = await _generate_spec(request)
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    except Exception as exc:
        return exception_response(exc)
    backend = _backend(request)
    if "image" in spec.output_modalities and hasattr(backend, "generate_images"):
        from mstar.server.image_routes import generate_images  # it imports this module

        return await generate_images(request, backend, spec, streaming)  # type: ignore[arg-type]
    try:
        first, events = await _start(lambda: backend.generate(spec), request)
    except Exception as exc:
        return exception_response(exc)
    rate: int | None = getattr(backend, "sample_rate", None)  # of "audio" data, if any
    if streaming:
        body = _generate_ndjson(spec.request_id, first, events, rate)
        return _stream(body, "application/x-ndjson")

    async def complete() -> Response:
        try:
            out = await _collect(first, events)
        except Exception as exc:
            return exception_response(exc)
        result: dict[str, Any] = {
            "request_id": spec.request_id,
            "text": "".join(out.text),
            "finish_reason": out.finish_reason,
            "usage": out.usage().model_dump(),
        }
        if out.data:
            result["data"] = {m: base64.b64encode(b).decode() for m, b in out.data.items()}
            if "audio" in out.data and rate:
                result["sample_rate"] = rate
        return JSONResponse(result)

    return await _unless_disconnected(request, complete)


async def _generate_ndjson(
    request_id: str, first: OutputEvent | None, events: Events, sample_rate: int | None = None
) -> AsyncIterator[str]:
    """One JSON line per event; the last line carries finish_reason and usage. Binary
    ``data`` is base64; audio lines carry ``sample_rate`` when the backend has one."""
    tally = Tally()

    def line(**payload: Any) -> str:
        return json.dumps({"request_id": request_id, **payload}) + "\n"

    try:
        async with aclosing(_walk(first, events, tally)) as walk:
            async for event in walk:
                payload: dict[str, Any] = {
                    "modality": event.modality,
                    "text": event.text,
                    "finish_reason": event.finish_reason,
                }
                if event.data is not None:
                    payload["data"] = base64.b64encode(event.data).decode()
                    if event.modality == "audio" and sample_rate:
                        payload["sample_rate"] = sample_rate
                if event.finish_reason:
                    payload["usage"] = tally.usage().model_dump()
                yield line(**payload)
        if tally.finish_reason is None:  # the backend ended without saying why
            usage = tally.usage().model_dump()
            yield line(modality="text", text="", finish_reason="stop", usage=usage)
    except Exception as exc:
        yield line(**_in_band_error(exc))


# ------------------------------------------------------------------------------- app


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
) -> FastAPI:
    """The HTTP app over ``backend``.

    ``served_model_names``: the names /v1/models lists and requests may use (default: the
    backend's ``model_id``, which is always accepted too). ``api_key``: if set, every route
    but /health needs ``Authorization: Bearer <api_key>`` (/metrics included).
    ``on_shutdown``: called (in a thread) when the ASGI server shuts the app down, e.g. to
    stop the workers: uvicorn re-raises SIGTERM once it has stopped, so code after
    ``uvicorn.run`` never runs then.
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
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.state.model_names = list(dict.fromkeys(served_model_names or [backend.model_id]))
    _install_error_handlers(app)

    router = APIRouter(dependencies=[Depends(_require_api_key(api_key))] if api_key else [])
    router.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList)
    from mstar.server.chat_routes import chat_completions  # it imports this module

    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                         openapi_extra=json_body_openapi(ChatCompletionRequest))
    router.add_api_route("/generate", generate, methods=["POST"], openapi_extra=form_body_openapi(
        GenerateForm, {"files": True}, urlencoded=True))
    router.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    if hasattr(backend, "transcribe"):  # speech-to-text backends get OpenAI's audio routes
        from mstar.server.audio_routes import audio_router  # it imports this module

        router.include_router(audio_router(backend))  # type: ignore[arg-type]
    if hasattr(backend, "speech"):  # text-to-speech backends get /v1/audio/speech
        from mstar.server.speech_routes import speech_router  # it imports this module

        router.include_router(speech_router(backend))  # type: ignore[arg-type]
    if hasattr(backend, "generate_images"):  # image models get OpenAI's image routes
        from mstar.server.image_routes import image_router  # it imports this module

        router.include_router(image_router(backend))  # type: ignore[arg-type]
    app.include_router(router)
    app.add_api_route("/health", health, methods=["GET"])
    return app
