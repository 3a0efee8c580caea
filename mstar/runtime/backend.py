"""The real ServingBackend: requests go through the model's ``prepare`` onto the runtime."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import aclosing
from typing import Any

from mstar.contract import (
    ChatSpec,
    CompletionSpec,
    GenerateSpec,
    ImageSpec,
    OutputEvent,
    RequestError,
    ServiceError,
    SessionSpec,
    SpeechSpec,
    Transcription,
    TranscriptionSpec,
    Voice,
)
from mstar.model.spec import ModelSpec, WalkOutput, WalkRequest
from mstar.runtime.handoff import AsyncSink
from mstar.runtime.pieces import stream_pieces
from mstar.runtime.runtime import Runtime

log = logging.getLogger(__name__)

PIECES_AHEAD = 1
"""Sentence pieces of one request running past the one streaming (their audio waits its turn)."""


class OnRuntime:
    """What a backend over a ``Runtime`` reports of it: health, the failure, live gauges."""

    runtime: Runtime

    def healthy(self) -> bool:
        return self.runtime.healthy

    @property
    def failure(self) -> str | None:
        """Why the runtime is unhealthy (a dead worker names its rank and process)."""
        return self.runtime.failure

    def gauges(self) -> dict[str, float]:
        return self.runtime.gauges()

    def replica_health(self) -> list[dict] | None:
        """Each data-parallel replica's state (``replicas: N``), None with one replica."""
        health = getattr(self.runtime, "health", None)
        return health() if health is not None else None


class RuntimeBackend(OnRuntime):
    def __init__(self, spec: ModelSpec, runtime: Runtime, *, timeout_s: float | None = None,
                 prepare_pool: Executor | None = None):
        self.spec = spec
        self.runtime = runtime
        self.model_id = spec.config.model
        self.tasks = spec.tasks
        self.max_model_len = spec.max_model_len
        self.timeout_s = timeout_s
        self.prepare_pool = prepare_pool  # None: asyncio's default executor

    async def _prepared(self, prepare: Callable[[], Any]) -> Any:
        """``prepare()`` off the event loop (tokenising and decoding media can take a while),
        on the deployment's ``prepare_threads`` pool, else on asyncio's default executor (as
        ``asyncio.to_thread``, context variables included)."""
        call = contextvars.copy_context().run
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, call, prepare)

    def gauges(self) -> dict[str, float]:
        """The runtime's gauges, and a cloning model's clip memo as ``conditioning_cache_*``."""
        gauges = dict(self.runtime.gauges())
        if self.clones_voices:
            stats = self.spec.clip_memo.stats()  # type: ignore[attr-defined]
            gauges.update({f"conditioning_cache_{name}": value for name, value in stats.items()})
        return gauges

    def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        return self._run(spec.request_id, lambda: self.spec.prepare_chat(spec), spec.stop)

    def complete(self, spec: CompletionSpec) -> AsyncIterator[OutputEvent]:
        return self._run(spec.request_id, lambda: self.spec.prepare_completion(spec), spec.stop)

    def generate(self, spec: GenerateSpec) -> AsyncIterator[OutputEvent]:
        if spec.files and "transcription" in self.spec.tasks:
            return self._generate_transcription(spec)
        stop = spec.model_kwargs.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if spec.reference is not None and not self.clones_voices:
            raise RequestError("ref_audio", f"model {self.model_id!r} does not support voice cloning")
        return self._pieces(spec.request_id, lambda: self.spec.prepare_generate(spec), list(stop), spec.session)

    def append(self, request_id: str, var: str, value) -> None:
        """Append one item to a running request's client stream (``Runtime.append``)."""
        self.runtime.append(request_id, var, value)

    def end_input(self, request_id: str) -> None:
        """The running request's client input ends (``Runtime.end_input``)."""
        self.runtime.end_input(request_id)

    @property
    def live_stream(self) -> str | None:
        """The client stream a ``/generate/ws`` socket's appends feed, all of them one
        request (a live call); None: each append is a request of the socket's session."""
        return getattr(self.spec, "live_stream", None)

    def append_item(self, data: bytes, field: str):
        """One appended file as an item of ``live_stream`` (the family decodes and checks it)."""
        return self.spec.append_item(data, field)

    def knows(self, request_id: str) -> bool:
        """Whether the request was submitted and has not ended."""
        return self.runtime.knows(request_id)

    def pin_session(self, session_id: str, pinned: bool = True) -> None:
        """Keep a session from eviction and expiry while a client holds it open (``/generate/ws``)."""
        self.runtime.pin_session(session_id, pinned)

    def end_session(self, session_id: str) -> None:
        """End a session (``/generate/ws`` at ``end_input`` or a hang-up): its kept state is freed."""
        self.runtime.end_session(session_id)

    # ---------------------------------------------------------------- images
    async def generate_images(self, spec: ImageSpec) -> list[bytes]:
        """``n`` walks (seeds seed, seed + 1, ...) run together; one PNG each."""
        prepare = getattr(self.spec, "prepare_image", None)
        if prepare is None:
            raise RequestError("model", f"model {self.model_id!r} does not make images")

        async def one(index: int) -> bytes:
            data, failed = None, None
            async for event in self._run(f"{spec.request_id}-{index}", lambda: prepare(spec, index), []):
                data = event.data or data
                failed = event if event.error else failed
            if failed is not None:
                raise _failure(failed)
            if data is None:
                raise ServiceError("the model produced no image")
            return data

        return list(await asyncio.gather(*[one(i) for i in range(spec.n)]))

    # ---------------------------------------------------------------- video
    @property
    def video_frame_step(self) -> int:
        """Frame counts the model makes are ``k * step + 1`` (the video VAE's time stride)."""
        return int(getattr(self.spec, "video_frame_step", 1))

    @property
    def video_knobs(self) -> type | None:
        """The request knobs (a ``RequestKnobs`` class) of the model's videos: the
        ``model_kwargs`` it takes and their defaults; None for a model that makes none."""
        return getattr(self.spec, "video_knobs", None)

    def check_video(self, spec: GenerateSpec) -> None:
        """The model's checks of a video request (``RequestError`` naming the field), run
        without queueing it; nothing for a model without them."""
        check = getattr(self.spec, "check_video", None)
        if check is not None:
            check(spec)

    @property
    def video_soundtrack(self) -> tuple[int, int] | None:
        """``(sample_rate, channels)`` of the audio a video model makes with its frames (its
        "audio" output: interleaved 16-bit PCM), None when it makes none."""
        return getattr(self.spec, "video_soundtrack", None)

    # ---------------------------------------------------------------- actions
    @property
    def action_chunk(self) -> int:
        """Actions in a robot policy's ``action`` output (0: the model makes none)."""
        return int(getattr(self.spec, "action_chunk", 0))

    # ------------------------------------------------------------ speech out
    @property
    def sample_rate(self) -> int:
        return int(getattr(self.spec, "sample_rate", 0))

    @property
    def validates_speech_options(self) -> bool:
        return bool(getattr(self.spec, "validates_speech_options", False))

    @property
    def takes_instructions(self) -> bool:
        """The model reads a speech request's ``instructions`` (from ``model_kwargs``)."""
        return bool(getattr(self.spec, "takes_instructions", False))

    @property
    def clones_voices(self) -> bool:
        return bool(getattr(self.spec, "clones_voices", False))

    def voices(self) -> list[str]:
        voices = getattr(self.spec, "voices", None)
        return voices() if voices else []

    def voice_list(self) -> list[Voice]:
        """The spec's ``voice_list()`` (names with language and source) where it has one."""
        described = getattr(self.spec, "voice_list", None)
        return described() if described else [Voice(name) for name in self.voices()]

    def speech(self, spec: SpeechSpec) -> AsyncIterator[OutputEvent]:
        prepare = getattr(self.spec, "prepare_speech", None)
        if prepare is None:
            raise RequestError("model", f"model {self.model_id!r} does not synthesise speech")
        if spec.reference is not None and not self.clones_voices:
            raise RequestError("ref_audio", f"model {self.model_id!r} does not support voice cloning")
        return self._pieces(spec.request_id, lambda: prepare(spec), [])

    async def _pieces(self, request_id: str, prepare, stop: list[str],
                      session: SessionSpec | None = None) -> AsyncIterator[OutputEvent]:
        """One walk's events, or, when ``prepare`` returns a list (a family that speaks long
        text as sentence pieces, one walk each), the pieces' walks as one stream in order,
        the next piece already running while one streams (``stream_pieces``)."""
        planned: WalkRequest | list[WalkRequest] = await self._prepared(prepare)
        if not isinstance(planned, list):
            planned = [planned]
        if not planned:
            raise RequestError("input", "has nothing to speak")
        if len(planned) == 1:
            events = self._run(request_id, lambda: planned[0], stop, session)
        elif session is not None:
            raise RequestError("session_id", f"model {self.model_id!r} splits this request into pieces, "
                                             "which cannot share a session")
        else:
            events = stream_pieces(planned, lambda i, piece: self._run(f"{request_id}-p{i}", lambda: piece, stop),
                                   ahead=PIECES_AHEAD)
        async with aclosing(events) as stream:
            async for event in stream:
                yield event

    async def _generate_transcription(self, spec: GenerateSpec) -> AsyncIterator[OutputEvent]:
        """/generate with an audio file on a speech recogniser: the transcript as text."""
        result = await self.transcribe(self.spec.transcription_of(spec))
        yield OutputEvent(text=result.text, finish_reason="stop")

    async def transcribe(self, spec: TranscriptionSpec) -> Transcription:
        transcribe = getattr(self.spec, "transcribe", None)
        if transcribe is None:
            raise RequestError("model", f"model {self.model_id!r} does not transcribe speech")
        counter = iter(range(1 << 30))

        async def run_walk(request: WalkRequest) -> WalkOutput:
            text, ids, data, failed = [], [], {}, None
            async for event in self._run(f"{spec.request_id}-{next(counter)}", lambda: request, []):
                text.append(event.text)
                ids += event.token_ids
                if event.data is not None:
                    data[event.modality] = data.get(event.modality, b"") + event.data
                failed = event if event.error else failed
            if failed is not None:
                raise _failure(failed)
            return WalkOutput("".join(text), ids, data)

        from mstar.audio import AudioError

        try:
            return await transcribe(spec, run_walk)
        except AudioError as err:
            raise RequestError(err.field, err.message, err.status) from None

    async def _run(self, request_id: str, prepare, stop: list[str],
                   session: SessionSpec | None = None) -> AsyncIterator[OutputEvent]:
        request: WalkRequest = await self._prepared(prepare)
        capacity = self.runtime.conductor.capacity
        for name, units in (request.peak | request.cost).items():
            units = max(units, request.peak.get(name, 0))
            if units > capacity.get(name, units):
                raise RequestError("max_tokens", f"the request needs {units} {name} but the deployment holds "
                                                 f"{capacity[name]}; ask for fewer tokens")
        sink = AsyncSink(asyncio.get_running_loop())
        self.runtime.submit(request_id, request, self.spec.output_stream(request, stop), sink, self.timeout_s,
                            session)
        finished = False
        echo = request.echo  # sent once the request is under way: a failure in the queue stays a plain error
        try:
            while True:
                for event in joined(await sink.take()):
                    if event is None:
                        finished = True
                        return
                    if echo and not event.error and event.finish_reason != "error":
                        yield OutputEvent(text=echo, prompt_tokens=request.prompt_tokens)
                    echo = ""
                    yield event
        finally:
            if not finished:
                self.runtime.cancel(request_id)


def joined(events: list[OutputEvent | None]) -> list[OutputEvent | None]:
    """``events`` that arrived together, each run of plain text deltas (no data, no finish,
    no error) joined into one: a stream that fell behind its tokens sends one chunk for the
    tokens waiting, not one per token. Other events pass as they are, in order."""
    out: list[OutputEvent | None] = []
    for event in events:
        last = out[-1] if out else None
        if _plain_text(event) and _plain_text(last):
            assert event is not None and last is not None
            out[-1] = OutputEvent(text=last.text + event.text, token_ids=last.token_ids + event.token_ids,
                                  prompt_tokens=max(last.prompt_tokens, event.prompt_tokens),
                                  completion_tokens=max(last.completion_tokens, event.completion_tokens))
        else:
            out.append(event)
    return out


def _plain_text(event: OutputEvent | None) -> bool:
    return (event is not None and event.modality == "text" and event.data is None and event.finish_reason is None
            and event.error is None)


def _failure(event: OutputEvent) -> RequestError:
    """What a route answers for a failed request's event: the client's mistake an engine found
    (a ``RequestError`` on the worker) names its field, anything else is a ``ServiceError``."""
    if event.error_field is not None:
        message = (event.error or "").removeprefix(f"{event.error_field}: ")
        return RequestError(event.error_field, message, event.error_status or 400)
    return ServiceError(event.error or "the request failed", event.error_status or 500)
