"""The Realtime API's events, as the official ``openai`` client (GA names) sends and reads them.

Client events are parsed into pydantic models, so that a bad one is answered with an
``error`` event whose ``param`` is the path of the field at fault
(``session.audio.input.turn_detection.threshold``). Fields we do not act on (tools, tracing,
noise reduction, ...) are ignored rather than refused: a stock client sends some of them.
Server events are plain dicts built by ``server_event``; their shapes are pinned by parsing
them with the ``openai`` package's own types (tests/server/test_realtime_events.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

__all__ = [
    "API_RATE", "AudioConfig", "ClientEvent", "ClientEventError", "ConversationItemCreate", "InputAudioBufferAppend",
    "InputAudioBufferClear", "InputAudioBufferCommit", "ItemContent", "MessageItem", "ResponseCancel",
    "ResponseCreate", "ResponseOverrides", "ServerVad", "SessionConfig", "SessionUpdate", "error_event",
    "event_id", "merge_session", "parse_client_event", "server_event",
]


API_RATE = 24000  # the API's PCM16 sample rate, in and out


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AudioFormat(_Model):
    """Only PCM16 at 24 kHz: what the API's ``audio/pcm`` is (G.711 is not offered)."""

    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class ServerVad(_Model):
    """``server_vad`` turn detection (Silero VAD; see docs/realtime.md)."""

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(0.5, gt=0.0, lt=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=10_000)
    silence_duration_ms: int = Field(500, ge=0, le=10_000)
    create_response: bool = True
    interrupt_response: bool = True


class InputTranscription(_Model):
    """Accepted for the client's sake: the backend's own recogniser transcribes every turn."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class AudioInput(_Model):
    format: AudioFormat = AudioFormat()
    turn_detection: ServerVad | None = ServerVad()
    transcription: InputTranscription | None = None


class AudioOutput(_Model):
    format: AudioFormat = AudioFormat()
    voice: str | None = None  # None: the backend's default voice


class AudioConfig(_Model):
    input: AudioInput = AudioInput()
    output: AudioOutput = AudioOutput()


Modalities = list[Literal["text", "audio"]]


def _one_modality(value: list[str]) -> list[str]:
    if len(value) != 1:
        raise ValueError('must be ["audio"] or ["text"]')
    return value


class SessionConfig(_Model):
    """The session as the server holds it (and echoes in ``session.created`` / ``.updated``)."""

    type: Literal["realtime", "transcription"] = "realtime"  # transcription: turns are transcribed, not answered
    id: str = ""
    object: Literal["realtime.session"] = "realtime.session"
    model: str | None = None
    instructions: str = ""
    output_modalities: Modalities = ["audio"]
    audio: AudioConfig = AudioConfig()
    max_output_tokens: int | Literal["inf"] = "inf"

    _modalities = field_validator("output_modalities")(_one_modality)

    @field_validator("max_output_tokens")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 4096:
            raise ValueError("must be between 1 and 4096, or 'inf'")
        return value


class InputAudioBufferAppend(_Model):
    type: Literal["input_audio_buffer.append"]
    event_id: str | None = None
    audio: str  # base64 PCM16 LE mono 24 kHz


class InputAudioBufferCommit(_Model):
    type: Literal["input_audio_buffer.commit"]
    event_id: str | None = None


class InputAudioBufferClear(_Model):
    type: Literal["input_audio_buffer.clear"]
    event_id: str | None = None


class SessionUpdate(_Model):
    type: Literal["session.update"]
    event_id: str | None = None
    session: dict[str, Any]  # merged into the session held, then validated as a whole


class ItemContent(_Model):
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text"]
    text: str | None = None
    audio: str | None = None  # base64 PCM16 24 kHz (input_audio)
    transcript: str | None = None


class MessageItem(_Model):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ItemContent] = Field(min_length=1)


class ConversationItemCreate(_Model):
    type: Literal["conversation.item.create"]
    event_id: str | None = None
    previous_item_id: str | None = None  # accepted; items are always appended at the end
    item: MessageItem


class ResponseAudio(_Model):
    output: AudioOutput | None = None


class ResponseOverrides(_Model):
    """What one ``response.create`` may change for its response only."""

    instructions: str | None = None
    output_modalities: Modalities | None = None
    audio: ResponseAudio | None = None
    max_output_tokens: int | Literal["inf"] | None = None

    @field_validator("output_modalities")
    @classmethod
    def _one(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else _one_modality(value)


class ResponseCreate(_Model):
    type: Literal["response.create"]
    event_id: str | None = None
    response: ResponseOverrides = ResponseOverrides()


class ResponseCancel(_Model):
    type: Literal["response.cancel"]
    event_id: str | None = None
    response_id: str | None = None


ClientEvent = (InputAudioBufferAppend | InputAudioBufferCommit | InputAudioBufferClear | SessionUpdate
               | ConversationItemCreate | ResponseCreate | ResponseCancel)
_ADAPTERS: dict[str, TypeAdapter] = {
    model.model_fields["type"].annotation.__args__[0]: TypeAdapter(model)  # type: ignore[union-attr]
    for model in ClientEvent.__args__  # type: ignore[attr-defined]
}


class ClientEventError(Exception):
    """A client event that cannot be acted on: becomes an ``error`` event; the socket stays."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.event_id = message, param, code, event_id


def _path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc]
    return (prefix + "".join(parts)).lstrip(".")


def validation_error(exc: ValidationError, prefix: str = "", event_id: str | None = None) -> ClientEventError:
    """The first complaint of ``exc``, naming its field's path."""
    first = exc.errors()[0]
    param = _path(tuple(first["loc"]), prefix)
    return ClientEventError(f"{param}: {first['msg']}", param or None, "invalid_value", event_id)


def parse_client_event(raw: str | bytes) -> ClientEvent:
    """A client frame as its event model; ``ClientEventError`` names what is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ClientEventError(f"the event is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ClientEventError("the event must be a JSON object", None, "invalid_json")
    sent_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    adapter = _ADAPTERS.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        known = ", ".join(sorted(_ADAPTERS))
        message = f"type: unknown event type {kind!r}; supported: {known}"
        raise ClientEventError(message, "type", "invalid_event_type", sent_id)
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        raise validation_error(exc, event_id=sent_id) from None


def merge_session(current: SessionConfig, update: dict[str, Any], event_id: str | None = None) -> SessionConfig:
    """``current`` with ``update``'s fields (nested objects merged, ``null`` kept: a
    ``turn_detection`` of null turns detection off), validated as a whole."""

    def merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out

    for fixed in ("id", "object"):
        update.pop(fixed, None)
    try:
        return SessionConfig.model_validate(merge(current.model_dump(), update))
    except ValidationError as exc:
        raise validation_error(exc, "session", event_id) from None


def event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event of type ``kind`` with a fresh ``event_id``."""
    return {"type": kind, "event_id": event_id(), **fields}


def error_event(message: str, param: str | None = None, code: str | None = None,
                client_event_id: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """An ``error`` event; ``client_event_id`` names the client event it answers."""
    error = {"type": kind, "code": code, "message": message, "param": param, "event_id": client_event_id}
    return server_event("error", error=error)
