"""OpenAI's speech-to-text routes: /v1/audio/transcriptions and /v1/audio/translations.

Both take OpenAI's multipart form (``file``, ``model``, ``language``, ``prompt``,
``response_format``, ``temperature``, ``timestamp_granularities[]``), check it, cap the
upload's size, and hand a ``TranscriptionSpec`` to the backend's ``transcribe``; the
backend decodes the audio. Errors keep OpenAI's body and name the offending field.
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import FormData, UploadFile

from mstar.audio.formats import RESPONSE_FORMATS, language_code, render_transcription
from mstar.audio.io import AudioError
from mstar.contract import TranscriptionSpec
from mstar.server.backend import TranscribingBackend
from mstar.server.bodies import capped_form
from mstar.server.errors import APIError, error_response, exception_response
from mstar.server.schemas import (
    TranscriptionForm,
    form_body_openapi,
    new_id,
    parse_model_kwargs,
)
from mstar.server.served import resolve_model
from mstar.server.streaming import unless_disconnected

MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # OpenAI's limit
_FORM_OVERHEAD = 1024 * 1024  # room for the other fields and the multipart framing
_GRANULARITIES = ("timestamp_granularities[]", "timestamp_granularities")


def _bad(param: str, message: str, status: int = 400, code: str = "invalid_value") -> APIError:
    return APIError(status, f"{param}: {message}", param, code)


def _too_large(size: int) -> APIError:
    message = f"upload is {size} bytes; the limit is {MAX_UPLOAD_BYTES} bytes"
    return _bad("file", message, 413, "file_too_large")


def _text(form: FormData, name: str) -> str | None:
    """A text field, stripped; None when absent or empty."""
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(name, "must be a text field, not a file")
    return value.strip() or None


def _response_format(form: FormData) -> str:
    fmt = _text(form, "response_format") or "json"
    if fmt not in RESPONSE_FORMATS:
        choices = ", ".join(RESPONSE_FORMATS)
        raise _bad("response_format", f"{fmt!r} is not supported; use one of {choices}")
    return fmt


def _temperature(form: FormData) -> float | None:
    raw = _text(form, "temperature")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise _bad("temperature", f"{raw!r} is not a number") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise _bad("temperature", f"must be between 0 and 1, got {raw}")
    return value


def _check_granularities(form: FormData) -> None:
    for name in _GRANULARITIES:
        for value in form.getlist(name):
            if value == "word":
                raise _bad(name, "word timestamps are not supported; use 'segment'")
            if value != "segment":
                raise _bad(name, f"{value!r} is not supported; use 'segment'")


async def _upload(form: FormData) -> tuple[str, bytes]:
    """The uploaded file's name and bytes, reading at most one byte past the limit."""
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        reason = "must be a file" if upload is not None else "an audio file is required"
        raise _bad("file", reason, code="missing_file" if upload is None else "invalid_value")
    data = await upload.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise _too_large(upload.size or len(data))
    return upload.filename or "audio", data


def _check_request(request: Request) -> None:
    """Refuse what is not a multipart form, or declares a body far past the size cap."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _bad("file", "the request must be multipart/form-data with the audio in 'file'")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES + _FORM_OVERHEAD:
        raise _too_large(int(declared))


async def _spec(request: Request, form: FormData, task: str) -> tuple[TranscriptionSpec, str]:
    """The backend's spec from the form, and the response format."""
    resolve_model(request, _text(form, "model"), "transcription" if task == "transcribe" else "translation")
    filename, audio = await _upload(form)
    fmt = _response_format(form)
    temperature = _temperature(form)
    _check_granularities(form)
    language = _text(form, "language") if task == "transcribe" else None
    spec = TranscriptionSpec(
        request_id=new_id("transcr" if task == "transcribe" else "transl"),
        audio=audio,
        filename=filename,
        task=task,
        language=language_code(language) if language else None,
        prompt=_text(form, "prompt"),
        temperature=temperature,
        model_kwargs=parse_model_kwargs(_text(form, "model_kwargs")),
    )
    return spec, fmt


async def _serve(request: Request, backend: TranscribingBackend, task: str) -> Response:
    try:
        _check_request(request)
        async with capped_form(request, max_bytes=MAX_UPLOAD_BYTES + _FORM_OVERHEAD, field="file",
                               max_files=1) as form:
            spec, fmt = await _spec(request, form, task)
    except Exception as exc:
        return exception_response(exc)

    async def work() -> Response:
        try:
            result = await backend.transcribe(spec)
        except AudioError as exc:
            message = f"{exc.field}: {exc.message}" if exc.field else exc.message
            return error_response(exc.status, message, exc.field)
        except Exception as exc:
            return exception_response(exc)
        body, media_type = render_transcription(result, fmt, task)
        return Response(body, media_type=media_type)

    return await unless_disconnected(request, work)


def audio_router(backend: TranscribingBackend) -> APIRouter:
    """The speech-to-text routes over ``backend``; its ``transcribe`` is called only once the
    route has checked that the model serves the task."""
    router = APIRouter()

    async def transcriptions(request: Request) -> Response:
        """Speech to text in the spoken language (OpenAI's multipart form)."""
        return await _serve(request, backend, "transcribe")

    async def translations(request: Request) -> Response:
        """Speech to English text (OpenAI's multipart form; no ``language``)."""
        return await _serve(request, backend, "translate")

    form = form_body_openapi(TranscriptionForm, {"file": False}, required_files=("file",))
    router.add_api_route("/v1/audio/transcriptions", transcriptions, methods=["POST"], openapi_extra=form)
    router.add_api_route("/v1/audio/translations", translations, methods=["POST"], openapi_extra=form)
    return router
