"""OpenAI's text-to-speech route, /v1/audio/speech, and a voice list, /v1/audio/voices (of a
speech model, or of a chat model that speaks its answers).

The JSON body follows OpenAI (``model``, ``input``, ``voice``, ``response_format``,
``speed``, ``stream_format``) plus M* extras: ``stream`` (send the audio as it is
produced, chunked), the sampling knobs ``temperature``, ``top_p``,
``repetition_penalty``, ``seed``, ``max_tokens``, and ``phonemes`` / ``lang_code`` for a
model with a G2P front end (they go into ``model_kwargs``); ``ref_audio`` / ``ref_text``, a
voice to clone (``voice_refs``: refused unless the model clones), and
``sentence_chunking``, whether to speak long text as ordered sentence pieces.
What the model cannot do (a speed other than 1.0, ``instructions``) is refused with a 400
naming the field, never silently ignored.

``stream_format: "sse"`` streams OpenAI's server-sent events instead of audio bytes: one
``speech.audio.delta`` per encoded chunk (``audio``: the chunk in ``response_format``,
base64) and a last ``speech.audio.done`` with the request's token usage; the chunks joined
are the streamed file.

The backend's first event is awaited before the response starts, so a ``RequestError``
from the backend is still a plain 4xx. Once audio is flowing, a failure is logged and
the connection is dropped (a truncated body, never a clean-looking short file). However
the request ends, the backend's iterator is closed, which cancels its work.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mstar.audio.encode import AudioEncoder
from mstar.audio.io import AudioError
from mstar.contract import OutputEvent, SpeechSpec, Voice
from mstar.server.backend import SpeakingBackend
from mstar.server.bodies import json_object
from mstar.server.errors import (
    APIError,
    BackendFailure,
    error_response,
    exception_response,
    validation_error_response,
)
from mstar.server.schemas import json_body_openapi, new_id, voice_id
from mstar.server.served import output_modalities, resolve_model
from mstar.server.streaming import (
    STREAM_HEADERS,
    ClosingStreamingResponse,
    Events,
    Tally,
    close_events,
    next_event,
    sse,
    start_events,
    unless_disconnected,
    walk_events,
)
from mstar.server.voice_refs import MAX_REF_TEXT_CHARS, resolve_reference

log = logging.getLogger(__name__)

MAX_INPUT_CHARS = 4096  # OpenAI's limit
MAX_BODY_BYTES = 48 * 1024 * 1024  # a reference clip of up to 32 MB, base64 in the JSON body
Chunks = AsyncGenerator[bytes, None]
_MODEL_KWARGS = ("temperature", "top_p", "repetition_penalty", "seed", "max_tokens", "phonemes", "lang_code",
                 "exaggeration", "cfg_weight", "min_p", "top_k", "language_id", "max_new_tokens", "watermark",
                 "phoneme_ids", "noise_scale", "noise_w",
                 "language", "non_streaming_mode", "x_vector_only_mode")


class SpeechRequest(BaseModel):
    """The body of POST /v1/audio/speech (OpenAI's fields plus M* extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: str | None = None
    instructions: str | None = None
    response_format: str = "wav"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: str | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    phonemes: str | None = None  # speak these phonemes, no G2P (models with a phoneme alphabet: Kokoro)
    lang_code: str | None = None  # the G2P language (Kokoro's one-letter codes)
    ref_audio: str | None = None  # a clip to clone: data URI, base64, or http(s) URL when allowed
    ref_text: str | None = Field(None, max_length=MAX_REF_TEXT_CHARS)  # the clip's transcript
    sentence_chunking: bool | None = None  # None: the model's default
    # Chatterbox's options: passed as sent, the model's strict options check them and name the field
    exaggeration: Any = None
    cfg_weight: Any = None
    min_p: Any = None
    top_k: Any = None
    language_id: Any = None
    max_new_tokens: Any = None
    watermark: Any = None
    # Piper's options, checked by its strict options likewise
    phoneme_ids: Any = None
    noise_scale: Any = None
    noise_w: Any = None
    language: Any = None  # the language to speak (Qwen3-TTS, OmniVoice: a name or an id), checked by the model
    # Qwen3-TTS's options, checked by its strict options likewise
    non_streaming_mode: Any = None
    x_vector_only_mode: Any = None

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, value: Any) -> Any:
        return voice_id(value)

    def model_kwargs(self) -> dict[str, Any]:
        kwargs = {k: v for k in _MODEL_KWARGS if (v := getattr(self, k)) is not None}
        if self.instructions:  # reaches a model only when it takes them (``_check``)
            kwargs["instructions"] = self.instructions
        return kwargs


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param, "invalid_value")


def _check(req: SpeechRequest, backend: SpeakingBackend) -> None:
    """Refuse what the JSON schema lets through but this server cannot honour."""
    if not req.input.strip():
        raise _bad("input", "must contain text, not only whitespace")
    # A model that validates its own speech options (voice blends, a speaking rate) says so;
    # for the others the route refuses what they cannot do.
    own_options = getattr(backend, "validates_speech_options", False)
    if req.speed != 1.0 and not own_options:
        raise _bad("speed", f"{req.speed:g} is not supported by this model; only 1.0 is")
    if req.instructions and not getattr(backend, "takes_instructions", False):
        raise _bad("instructions", "voice instructions are not supported by this model")
    if req.stream_format not in (None, "audio", "sse"):
        raise _bad("stream_format", f"{req.stream_format!r} is not supported; use 'audio' or 'sse'")
    if req.voice is not None and not own_options and req.ref_audio is None:  # a clone's voice is the clip
        voices = list(backend.voices())
        if req.voice not in voices:
            known = f"use one of {', '.join(voices)}" if voices else "this model has no voices"
            raise _bad("voice", f"unknown voice {req.voice!r}; {known}")


async def _parse(request: Request) -> SpeechRequest:
    return SpeechRequest.model_validate(await json_object(request, max_bytes=MAX_BODY_BYTES))


async def _pcm(first: OutputEvent | None, events: Events) -> Chunks:
    """The float32 PCM chunks of the backend's audio events, from ``first`` on; stops
    after the event with a finish_reason and always closes ``events``."""
    try:
        event = first
        while event is not None:
            if event.error or event.finish_reason == "error":
                raise BackendFailure.of(event, "the backend failed to synthesize speech")
            if event.data and event.modality == "audio":
                yield event.data
            if event.finish_reason:
                return
            event = await next_event(events)
    finally:
        await close_events(events)


async def _encoded(
    encoder: AudioEncoder, first: OutputEvent | None, events: Events
) -> Chunks:
    """The response body, encoded as the audio comes."""
    async with aclosing(_pcm(first, events)) as chunks:
        async for chunk in chunks:
            if out := encoder.feed(chunk):
                yield out
    if tail := encoder.finish():
        yield tail


async def _events(encoder: AudioEncoder, first: OutputEvent | None, events: Events) -> AsyncGenerator[str, None]:
    """OpenAI's speech events: ``speech.audio.delta`` per encoded chunk, then
    ``speech.audio.done`` with the usage (input tokens: the prompt's, output: what the model
    generated; zero for a model that counts none)."""
    tally = Tally()

    def delta(chunk: bytes) -> str:
        return sse({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode("ascii")})

    async with aclosing(walk_events(first, events, tally)) as walk:
        async for event in walk:
            if event.data and event.modality == "audio" and (out := encoder.feed(event.data)):
                yield delta(out)
    if tail := encoder.finish():
        yield delta(tail)
    usage = tally.usage()
    yield sse({"type": "speech.audio.done", "usage": {"input_tokens": usage.prompt_tokens,
                                                      "output_tokens": usage.completion_tokens,
                                                      "total_tokens": usage.total_tokens}})


async def _logged(body: AsyncGenerator, request_id: str) -> AsyncGenerator:
    """``body`` for a response already under way: a failure is logged and re-raised, so
    that the server drops the connection and the client sees a broken transfer."""
    try:
        async with aclosing(body) as parts:
            async for part in parts:
                yield part
    except Exception as exc:  # one line here; the ASGI server logs the traceback
        log.error("speech request %s failed mid-stream, dropping it: %s", request_id, exc)
        raise BackendFailure(f"speech request {request_id} failed mid-stream") from exc


def _headers(encoder: AudioEncoder) -> dict[str, str]:
    return {"X-Sample-Rate": str(encoder.sample_rate), "X-Audio-Format": encoder.format}


async def _speech(request: Request, backend: SpeakingBackend) -> Response:
    try:
        req = await _parse(request)
        name = resolve_model(request, req.model, "speech")
        _check(req, backend)
        events_stream = req.stream_format == "sse"
        encoder = AudioEncoder(req.response_format, backend.sample_rate, streaming=req.stream or events_stream)
        reference = await resolve_reference(backend, name, req.ref_audio, req.ref_text)
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    except AudioError as exc:
        return error_response(exc.status, f"{exc.field}: {exc.message}", exc.field)
    except Exception as exc:
        return exception_response(exc)

    spec = SpeechSpec(
        request_id=new_id("speech"),
        input=req.input,
        voice=req.voice,
        speed=req.speed,
        model_kwargs=req.model_kwargs(),
        reference=reference,
        sentence_chunking=req.sentence_chunking,
        stream=bool(req.stream) or events_stream,
    )
    try:
        first, events = await start_events(lambda: backend.speech(spec), request)
    except Exception as exc:
        return exception_response(exc)
    if events_stream:
        return ClosingStreamingResponse(_logged(_events(encoder, first, events), spec.request_id),
                                        media_type="text/event-stream",
                                        headers={**STREAM_HEADERS, **_headers(encoder)})
    body = _encoded(encoder, first, events)
    if req.stream:
        headers = {**STREAM_HEADERS, **_headers(encoder)}
        streamed = _logged(body, spec.request_id)
        return ClosingStreamingResponse(streamed, media_type=encoder.media_type, headers=headers)

    async def complete() -> Response:
        parts: list[bytes] = []
        try:
            async with aclosing(body) as chunks:
                async for part in chunks:
                    parts.append(part)
        except Exception as exc:
            return exception_response(exc)
        return Response(b"".join(parts), media_type=encoder.media_type, headers=_headers(encoder))

    return await unless_disconnected(request, complete)


def voice_list(backend: SpeakingBackend) -> list[Voice]:
    """The backend's ``voice_list()`` where it has one, else its voice names, bare."""
    described = getattr(backend, "voice_list", None)
    return list(described()) if described is not None else [Voice(n) for n in backend.voices()]


def _voiced_model(request: Request, model: str | None, backend: SpeakingBackend) -> str:
    """The model /v1/audio/voices lists the voices of: one that serves speech, or a chat model
    that speaks its answers (``output_modalities`` with audio); any other is a 400 naming ``model``."""
    try:
        return resolve_model(request, model, "speech")
    except APIError:
        if "audio" not in output_modalities(backend):  # type: ignore[arg-type]
            raise
        return resolve_model(request, model, "chat")


def speech_router(backend: SpeakingBackend) -> APIRouter:
    """The text-to-speech routes over ``backend``; its ``speech`` and ``voices`` are called
    only once the route has checked that the model serves speech."""
    router = APIRouter()

    async def speech(request: Request) -> Response:
        """Text to speech (OpenAI's JSON body); the audio file, or chunks with stream."""
        return await _speech(request, backend)

    async def voices(request: Request, model: str | None = None) -> JSONResponse:
        """The voices ``voice`` may name: each with the model it belongs to, its language
        (ISO-639-1) where known, and whether it is ``bundled`` or a ``preset`` clip."""
        name = _voiced_model(request, model, backend)
        return JSONResponse({"voices": [
            {"voice_id": v.name, "name": v.name, "model": name, "language": v.language, "source": v.source}
            for v in voice_list(backend)]})

    router.add_api_route("/v1/audio/speech", speech, methods=["POST"], openapi_extra=json_body_openapi(SpeechRequest))
    router.add_api_route("/v1/audio/voices", voices, methods=["GET"])
    return router
