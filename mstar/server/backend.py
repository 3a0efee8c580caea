"""What the HTTP layer needs of a backend.

The FastAPI app (``mstar.server.app``) talks only to a ``ServingBackend``; the runtime
provides the real one, tests can provide a fake. Validation that needs the model (prompt
too long for the context, unknown voice, ...) raises ``RequestError`` from the backend. The
request and event types themselves are the contract of ``mstar.contract``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from mstar.contract import (
    ChatSpec,
    CompletionSpec,
    GenerateSpec,
    ImageSpec,
    OutputEvent,
    SpeechSpec,
    Transcription,
    TranscriptionSpec,
)


class ServingBackend(Protocol):
    """What the app needs. Optional extras it uses when present: ``failure`` (a property:
    why the backend is unhealthy, for /health), ``gauges()`` (a ``dict[str, float]`` of
    live values for /metrics: ``requests_waiting``, ``requests_running`` and per-engine
    ``rank<R>.<node>.<stat>``), ``input_modalities`` (what chat content may hold, e.g.
    ``{"text", "image", "video", "audio"}``; absent: the model spec's, else text only) and
    ``output_modalities`` (what a chat answer may be made of: ``{"text", "audio"}`` for a
    model that speaks; absent: the model spec's, else text only).

    A backend that speaks its chat answers also has ``sample_rate`` and ``voices()`` (as a
    ``SpeakingBackend``; an empty list leaves ``audio.voice`` to the model) and answers a
    ``ChatSpec`` whose ``output_modalities`` hold ``audio`` with text events (the transcript)
    and audio events carrying mono float32 little-endian PCM at ``sample_rate``, in the
    order they are made; ``spec.audio`` holds the voice and the client's format, which the
    route encodes."""

    model_id: str  # the served model's name (registry key), as /v1/models lists it
    max_model_len: int
    # what the model serves, of mstar.contract.TASKS: each route checks its task against it
    # (a backend has the methods of the tasks it serves: ``transcribe``, ``speech``, ...)
    tasks: frozenset[str]

    def healthy(self) -> bool: ...

    def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        """Stream the request's events. Closing the iterator early cancels the request."""

    def generate(self, spec: GenerateSpec) -> AsyncIterator[OutputEvent]: ...


class CompletingBackend(Protocol):
    """A backend whose model continues a raw prompt (``text_completion``): ``complete``
    streams like ``chat``; with ``spec.echo`` the first event's text is the prompt's."""

    def complete(self, spec: CompletionSpec) -> AsyncIterator[OutputEvent]: ...


class TranscribingBackend(Protocol):
    """A backend whose model turns speech into text."""

    async def transcribe(self, spec: TranscriptionSpec) -> Transcription: ...


class SpeakingBackend(Protocol):
    """A backend whose model turns text into speech. ``speech`` streams events whose
    ``data`` is mono float32 little-endian PCM at ``sample_rate`` (modality "audio").
    Optional: ``voice_list()``, the voices with their language and source for
    /v1/audio/voices (absent: the names of ``voices()``)."""

    sample_rate: int
    # True when the model checks ``voice`` (blends) and ``speed`` itself; otherwise the route
    # accepts only a listed voice and speed 1.0. Read with getattr: absent means False.
    validates_speech_options: bool
    # True when the model clones a voice from a clip (``SpeechSpec.reference``); otherwise a
    # request with ``ref_audio`` is refused. Read with getattr: absent means False.
    clones_voices: bool

    def voices(self) -> list[str]: ...

    def speech(self, spec: SpeechSpec) -> AsyncIterator[OutputEvent]: ...


class RespondingBackend(Protocol):
    """A backend that holds a conversation in speech (task ``realtime``: /v1/realtime).
    ``transcribe`` reads the user's turn; ``respond`` answers the conversation so far
    (``spec.messages``, the deployment's system prompt put first when they have none; sampling
    left at ``SamplingParams()``'s defaults means the deployment's, as GA has no knob): the
    reply's text as it is written (modality "text", deltas) and, with ``audio``, its speech
    (modality "audio": mono float32 little-endian PCM at ``sample_rate``, in ``voice``), each
    sentence spoken as soon as the text holds it. The last event has ``finish_reason``.
    Closing the iterator early cancels every walk of the reply and frees what they held."""

    sample_rate: int

    def voices(self) -> list[str]: ...

    async def transcribe(self, spec: TranscriptionSpec) -> Transcription: ...

    def respond(self, spec: ChatSpec, *, voice: str | None = None, audio: bool = True) -> AsyncIterator[OutputEvent]:
        ...


class ImagingBackend(Protocol):
    """A backend whose model makes images: ``generate_images`` returns one PNG per image."""

    async def generate_images(self, spec: ImageSpec) -> list[bytes]: ...
