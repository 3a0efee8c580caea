"""/v1/chat/completions: OpenAI's chat route, plain and SSE streaming, with image, video and
audio content parts for the models that take them (fetched through mstar/media/fetch.py, or
decoded from ``input_audio``, before the request is admitted), and a spoken answer for the
models that speak (``modalities: ["text", "audio"]``; see ``chat_audio``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mstar.contract import OutputEvent, RequestError
from mstar.server.backend import ServingBackend
from mstar.server.bodies import fetch_all, json_body
from mstar.server.chat_audio import AudioDeltas, check_audio_output, input_audio_bytes, sample_rate, whole_answer
from mstar.server.errors import (
    APIError,
    exception_response,
    in_band_error,
)
from mstar.server.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    DeltaAudio,
    Usage,
    new_id,
    now,
)
from mstar.server.served import backend_of, resolve_model
from mstar.server.streaming import (
    Events,
    Tally,
    collect_events,
    sse,
    start_events,
    stream_response,
    text_chunks,
    unless_disconnected,
    walk_events,
)

MAX_CHAT_BODY_BYTES = 128 * 1024 * 1024  # a chat request's JSON, inline media included
MAX_CHAT_MEDIA = 32  # image, video and audio parts per chat request
MAX_CHAT_MEDIA_BYTES = {"image": 20 * 1024 * 1024, "video": 64 * 1024 * 1024,
                        "audio": 25 * 1024 * 1024}  # per part, once fetched or decoded
_PLURAL = {"image": "images", "video": "videos", "audio": "audio"}


def input_modalities(backend: ServingBackend) -> frozenset[str]:
    """What the served model's chat content may hold: the backend's ``input_modalities``,
    else its model spec's (the runtime's backend), else text only."""
    declared = getattr(backend, "input_modalities", None)
    if declared is None:
        declared = getattr(getattr(backend, "spec", None), "input_modalities", None)
    return frozenset(declared or ("text",))


async def _chat_media(req: ChatCompletionRequest, model: str, backend: ServingBackend) -> list[bytes] | None:
    """The bytes of the request's image, video and audio parts, in order; None for a
    text-only model, which gets a 400 naming the first media part instead. Audio parts are
    decoded here; image and video parts are fetched, all at once."""
    modalities = input_modalities(backend)
    parts = req.media_parts()
    for name, part in parts:
        if part.modality not in modalities:
            raise RequestError(name, f"model {model!r} does not take {_PLURAL[part.modality]}")
    if len(parts) > MAX_CHAT_MEDIA:
        raise RequestError(parts[MAX_CHAT_MEDIA][0], f"at most {MAX_CHAT_MEDIA} images, videos and audio clips "
                                                     f"per request, got {len(parts)}")
    if not modalities - {"text"}:
        return None
    data: list[bytes | None] = [input_audio_bytes(part.input_audio, name, MAX_CHAT_MEDIA_BYTES["audio"])
                                if part.input_audio is not None else None for name, part in parts]
    fetches = [(i, (getattr(part, part.type).url, f"{name}.{part.type}.url", MAX_CHAT_MEDIA_BYTES[part.modality]))
               for i, (name, part) in enumerate(parts) if data[i] is None]
    for (i, _), fetched in zip(fetches, await fetch_all([ref for _, ref in fetches]), strict=True):
        data[i] = fetched
    return data  # type: ignore[return-value]


# ChatSpec fields the chat body calls otherwise
_BODY_NAMES = {"output_modalities": "modalities"}


def _in_body_terms(exc: Exception) -> Exception:
    """A model's refusal naming a ``ChatSpec`` field, renamed to the body's field that the
    client sent (a model refusing speech for an image prompt names ``output_modalities``)."""
    if type(exc) is RequestError and exc.field in _BODY_NAMES:
        return RequestError(_BODY_NAMES[exc.field], exc.message, exc.status)
    return exc


async def chat_completions(request: Request) -> Response:
    req = await json_body(request, ChatCompletionRequest, max_bytes=MAX_CHAT_BODY_BYTES)
    model = resolve_model(request, req.model, "chat")
    backend = backend_of(request)
    max_tokens = req.effective_max_tokens
    if max_tokens is not None and max_tokens > backend.max_model_len:
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        message = f"{param}: must be at most the context length ({backend.max_model_len})"
        raise APIError(400, message, param, "invalid_value")

    request_id = new_id("chatcmpl")
    try:
        check_audio_output(req, backend, model)
        speaks = req.audio is not None and "audio" in req.output_modalities
        rate = sample_rate(backend) if speaks else 0
        spec = req.to_spec(request_id, await _chat_media(req, model, backend))
        first, events = await start_events(lambda: backend.chat(spec), request)
    except Exception as exc:
        return exception_response(_in_body_terms(exc))
    if req.stream:
        deltas = AudioDeltas(rate) if speaks else None
        body = _chat_sse(request_id, model, first, events, req.include_usage, deltas)
        return stream_response(body, "text/event-stream")

    async def complete() -> Response:
        try:
            out = await collect_events(first, events)
            text = "".join(out.text)
            if speaks:
                audio = whole_answer(out.data.get("audio", b""), text, req.audio.format, rate)
                message = AssistantMessage(content=None, audio=audio)
            else:
                message = AssistantMessage(content=text)
        except Exception as exc:
            return exception_response(exc)
        choice = Choice(message=message, finish_reason=out.finish_reason)
        result = ChatCompletion(id=request_id, model=model, choices=[choice], usage=out.usage())
        return JSONResponse(result.model_dump())

    return await unless_disconnected(request, complete)


async def _chat_sse(
    request_id: str, model: str, first: OutputEvent | None, events: Events, include_usage: bool,
    audio: AudioDeltas | None = None,
) -> AsyncIterator[str]:
    """SSE chunks: the role, content deltas (with ``audio``: ``delta.audio`` pieces of
    transcript and PCM16, then the closing piece), finish_reason, [usage], then ``[DONE]``."""
    created = now()

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        body = ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse(body.model_dump())

    def spoken(piece: DeltaAudio) -> str:
        return chunk([ChunkChoice(delta=Delta(audio=piece))])

    content = text_chunks(lambda text: chunk([ChunkChoice(delta=Delta(content=text))]))
    tally = Tally()
    try:
        yield chunk([ChunkChoice(delta=Delta(role="assistant", content=None if audio else ""))])
        async with aclosing(walk_events(first, events, tally)) as walk:
            async for event in walk:
                if audio is None:
                    if event.modality == "text" and event.text:
                        yield content(event.text)
                elif event.modality == "text" and (piece := audio.transcript(event.text)):
                    yield spoken(piece)
                elif event.modality == "audio" and event.data and (piece := audio.speech(event.data)):
                    yield spoken(piece)
        if audio is not None:
            yield spoken(audio.last())
        yield chunk([ChunkChoice(delta=Delta(), finish_reason=tally.finish_reason or "stop")])
        if include_usage:
            yield chunk([], usage=tally.usage())
    except Exception as exc:  # the stream has started: report in band, then end it
        yield sse(in_band_error(exc))
    yield sse("[DONE]")
