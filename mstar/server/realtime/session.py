"""One Realtime connection's state: its session settings, input audio buffer, conversation
and the response being spoken, driven by client events and by turn detection.

Everything runs on the event loop; the only waits are the backend's (transcription, the
reply's stream) and the VAD step (in a thread). Server events go out through ``send``
(a queue the route's writer drains), so a response streams while client events, barge-in
included, are still read. A response is an ``asyncio`` task: cancelling it (``response.cancel``,
the user speaking over it, the socket closing) closes the backend's ``respond`` iterator,
which cancels its walks and frees what they held, then reports ``response.done`` cancelled.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf

from mstar.contract import ChatSpec, RequestError, SamplingParams, TranscriptionSpec
from mstar.model.vad import TurnEvent, TurnSettings
from mstar.server.backend import RespondingBackend
from mstar.server.realtime.events import (
    API_RATE,
    ClientEventError,
    ConversationItemCreate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    ResponseCancel,
    ResponseCreate,
    ResponseOverrides,
    SessionConfig,
    SessionUpdate,
    error_event,
    merge_session,
    parse_client_event,
    server_event,
)
from mstar.server.realtime.reply import Item, Reply
from mstar.server.realtime.resample import pcm16_to_float
from mstar.server.realtime.vad import VadHub
from mstar.server.schemas import new_id

__all__ = ["RealtimeSession"]

log = logging.getLogger(__name__)

MIN_COMMIT_MS = 100  # as the API: a shorter buffer cannot be committed
MAX_BUFFER_S = 15 * 60  # input held before a commit, at most
_IDLE_KEEP_MS = 500  # audio kept before speech starts, beyond the prefix padding (VAD lag)
# A silence this long within a turn starts reading the turn so far, while the rest of
# ``silence_duration_ms`` is still being timed: if nobody speaks again, that transcript is the
# turn's and the reply starts that much sooner; if someone does, it is cancelled.
EARLY_TRANSCRIPT_MS = 200


@dataclass
class _Response:
    id: str
    task: asyncio.Task | None = None
    reason: str | None = None  # why it was cancelled: turn_detected, client_cancelled


def _wav(pcm16: bytes) -> bytes:
    """The API's PCM16 24 kHz mono as a WAV file, what ``TranscriptionSpec.audio`` holds."""
    out = io.BytesIO()
    sf.write(out, np.frombuffer(pcm16, "<i2"), API_RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _b64_audio(data: str, param: str) -> bytes:
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ClientEventError(f"{param}: not valid base64", param) from None
    if len(pcm) % 2:
        raise ClientEventError(f"{param}: PCM16 audio has an even number of bytes", param)
    return pcm


class RealtimeSession:
    """A connection's conversation. ``start`` sends ``session.created``; ``handle`` takes each
    client frame; ``close`` cancels whatever still runs."""

    def __init__(self, backend: RespondingBackend, send: Callable[[dict[str, Any]], None], vad: VadHub,
                 model: str) -> None:
        self.backend, self.send, self.vad = backend, send, vad
        self.key = new_id("sess")
        # a backend that only transcribes (a speech recogniser) holds transcription sessions
        self.responds = callable(getattr(backend, "respond", None))
        self.config = SessionConfig(id=self.key, model=model, type="realtime" if self.responds else "transcription")
        self.items: list[Item] = []
        self._buffer = bytearray()  # input since the last commit or clear, PCM16 24 kHz
        self._stream_pos = 0  # samples appended since the VAD stream (re)started
        self._buffer_pos = 0  # that stream's position of _buffer[0]
        self._turn: tuple[str, int] | None = None  # (item id, start ms) while the user speaks
        self._response: _Response | None = None
        self._transcribing: set[asyncio.Task] = set()
        self._early: tuple[int, asyncio.Task] | None = None  # (speech end ms, its transcription) in a pause

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._restart_vad()
        self.send(server_event("session.created", session=self.config.model_dump(mode="json")))

    async def close(self) -> None:
        self._cancel_response("client_cancelled")
        self._drop_early()
        tasks = [*self._transcribing, *([self._response.task] if self._response and self._response.task else [])]
        for task in self._transcribing:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.vad.close(self.key)

    async def handle(self, raw: str | bytes) -> None:
        """One client frame; a bad one is answered with an ``error`` event naming its field."""
        event_id = None
        try:
            event = parse_client_event(raw)
            event_id = event.event_id
            await self._dispatch(event)
        except ClientEventError as exc:
            self.send(error_event(exc.message, exc.param, exc.code, exc.event_id or event_id))
        except Exception as exc:  # our fault or the backend's: said, and the session goes on
            log.exception("a realtime event failed")
            self.send(error_event(f"the server failed to handle the event: {exc}", None, "server_error",
                                  event_id, kind="server_error"))

    async def _dispatch(self, event: Any) -> None:
        if isinstance(event, InputAudioBufferAppend):
            await self._append(_b64_audio(event.audio, "audio"))
        elif isinstance(event, InputAudioBufferCommit):
            self._commit_by_hand()
        elif isinstance(event, InputAudioBufferClear):
            self._clear()
        elif isinstance(event, SessionUpdate):
            await self._update(event)
        elif isinstance(event, ConversationItemCreate):
            self._create_item(event)
        elif isinstance(event, ResponseCreate):
            self._create_response(event.response)
        elif isinstance(event, ResponseCancel):
            self._cancel_by_client(event)

    # ------------------------------------------------------------------ session

    async def _update(self, event: SessionUpdate) -> None:
        config = merge_session(self.config, event.session, event.event_id)
        if not self.responds and config.type != "transcription":
            raise ClientEventError(f"session.type: model {config.model!r} only transcribes; use 'transcription'",
                                   "session.type", "invalid_value", event.event_id)
        self._check_voice(config.audio.output.voice, "session.audio.output.voice")
        detection_changed = config.audio.input.turn_detection != self.config.audio.input.turn_detection
        self.config = config
        if detection_changed:
            await self._restart_vad()
        self.send(server_event("session.updated", session=config.model_dump(mode="json")))

    def _check_voice(self, voice: str | None, param: str) -> None:
        if voice is None:
            return
        voices = self.backend.voices()
        if voices and voice not in voices:
            raise ClientEventError(f"{param}: unknown voice {voice!r}; voices: {', '.join(voices)}", param)

    async def _restart_vad(self) -> None:
        """(Re)start turn detection with the session's settings; its clock starts at zero."""
        detection = self.config.audio.input.turn_detection
        self._turn = None
        self._buffer_pos -= self._stream_pos
        self._stream_pos = 0
        if detection is None:
            await self.vad.close(self.key)
            return
        early = EARLY_TRANSCRIPT_MS if detection.silence_duration_ms > EARLY_TRANSCRIPT_MS else None
        settings = TurnSettings(threshold=detection.threshold, prefix_padding_ms=detection.prefix_padding_ms,
                                silence_duration_ms=detection.silence_duration_ms, pause_ms=early)
        try:
            await self.vad.open(self.key, settings, self._on_turn)
        except Exception as exc:  # no silero-vad package, say: the session goes on without it
            log.warning("server VAD is unavailable: %s", exc)
            self.config = self.config.model_copy(update={"audio": self.config.audio.model_copy(update={
                "input": self.config.audio.input.model_copy(update={"turn_detection": None})})})
            param = "session.audio.input.turn_detection"
            self.send(error_event(f"{param}: server VAD is unavailable here ({exc}); install mstar[realtime]",
                                  param, "turn_detection_unavailable", kind="server_error"))

    # ------------------------------------------------------------------ input audio

    async def _append(self, pcm: bytes) -> None:
        if len(self._buffer) + len(pcm) > MAX_BUFFER_S * API_RATE * 2:
            raise ClientEventError(f"audio: the input buffer holds at most {MAX_BUFFER_S} s; commit or clear it",
                                   "audio", "input_audio_buffer_full")
        self._buffer += pcm
        self._stream_pos += len(pcm) // 2
        if self.key in self.vad:
            await self.vad.feed(self.key, pcm16_to_float(pcm))
            self._drop_idle_audio()

    def _drop_idle_audio(self) -> None:
        """While nobody speaks, keep only what a turn starting now could still reach back to."""
        detection = self.config.audio.input.turn_detection
        if self._turn is not None or detection is None:
            return
        keep = (detection.prefix_padding_ms + _IDLE_KEEP_MS) * API_RATE // 1000
        drop = len(self._buffer) // 2 - keep
        if drop > 0:
            del self._buffer[: 2 * drop]
            self._buffer_pos += drop

    def _span(self, start_ms: int | None, end_ms: int | None) -> tuple[int, int]:
        """Where ``start_ms`` to ``end_ms`` of the VAD stream (None: its ends) lie in the buffer, in samples."""
        start = 0 if start_ms is None else max(0, start_ms * API_RATE // 1000 - self._buffer_pos)
        end = len(self._buffer) // 2 if end_ms is None else end_ms * API_RATE // 1000 - self._buffer_pos
        return start, min(max(end, start), len(self._buffer) // 2)

    def _take(self, start_ms: int | None, end_ms: int | None) -> bytes:
        """The buffer's audio from ``start_ms`` to ``end_ms``; what precedes ``end_ms`` leaves the buffer."""
        start, end = self._span(start_ms, end_ms)
        pcm = bytes(self._buffer[2 * start: 2 * end])
        del self._buffer[: 2 * end]
        self._buffer_pos += end
        return pcm

    def _clear(self) -> None:
        self._drop_early()
        self._take(None, None)
        self._turn = None
        self.send(server_event("input_audio_buffer.cleared"))

    def _commit_by_hand(self) -> None:
        if len(self._buffer) // 2 < MIN_COMMIT_MS * API_RATE // 1000:
            raise ClientEventError(f"the input audio buffer holds less than {MIN_COMMIT_MS} ms of audio",
                                   None, "input_audio_buffer_commit_empty")
        item_id = self._turn[0] if self._turn else new_id("item")
        self._turn = None
        self._drop_early()
        self._commit(self._take(None, None), item_id)

    def _on_turn(self, turn: TurnEvent) -> None:
        """Turn detection heard the user start or stop speaking."""
        detection = self.config.audio.input.turn_detection
        if detection is None:
            return
        if turn.kind == "paused":
            if self._turn is not None:
                self._read_early(*self._turn, turn.ms)
            return
        early, self._early = self._early, None
        if turn.kind == "started":
            if early is not None:
                early[1].cancel()
            item_id = new_id("item")
            self._turn = (item_id, turn.ms)
            self.send(server_event("input_audio_buffer.speech_started", audio_start_ms=turn.ms, item_id=item_id))
            if detection.interrupt_response:
                self._cancel_response("turn_detected")
            return
        if self._turn is None:
            return
        item_id, start_ms = self._turn
        self._turn = None
        self.send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=turn.ms, item_id=item_id))
        if early is not None and early[0] != turn.ms:  # the user spoke again after that pause
            early[1].cancel()
            early = None
        self._commit(self._take(start_ms, turn.ms), item_id, early[1] if early else None)
        if detection.create_response and self._response is None and self.config.type == "realtime":
            self._start_response(ResponseOverrides())

    def _read_early(self, item_id: str, start_ms: int, end_ms: int) -> None:
        """Transcribe the turn so far during a pause (``EARLY_TRANSCRIPT_MS``), keeping the audio."""
        self._drop_early()
        start, end = self._span(start_ms, end_ms)
        spec = self._transcription(bytes(self._buffer[2 * start: 2 * end]), item_id)
        task = asyncio.get_running_loop().create_task(self.backend.transcribe(spec))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a dropped one's failure is no news
        self._early = (end_ms, task)

    def _drop_early(self) -> None:
        if self._early is not None:
            self._early[1].cancel()
            self._early = None

    def _commit(self, pcm: bytes, item_id: str, early: asyncio.Task | None = None) -> None:
        """The audio becomes a user item; its transcript follows when the backend has read it
        (``early``: the transcription of this same audio, started in the pause that ended the turn)."""
        previous = self.items[-1].id if self.items else None
        self.send(server_event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous))
        self._add_audio_item(Item(item_id, "user", "input_audio", None, "in_progress"), pcm, previous, early)

    def _add_audio_item(self, item: Item, pcm: bytes, previous: str | None, early: asyncio.Task | None = None) -> None:
        self.items.append(item)
        self.send(server_event("conversation.item.added", item=item.json(), previous_item_id=previous))
        task = asyncio.get_running_loop().create_task(self._transcribe(item, pcm, previous, early))
        self._transcribing.add(task)
        task.add_done_callback(self._transcribing.discard)

    def _transcription(self, pcm: bytes, item_id: str) -> TranscriptionSpec:
        wanted = self.config.audio.input.transcription
        return TranscriptionSpec(request_id=new_id("transcr"), audio=_wav(pcm), filename=f"{item_id}.wav",
                                 language=wanted.language if wanted else None,
                                 prompt=wanted.prompt if wanted else None)

    async def _transcribe(self, item: Item, pcm: bytes, previous: str | None, early: asyncio.Task | None) -> None:
        try:
            result = await (early if early is not None else self.backend.transcribe(self._transcription(pcm, item.id)))
        except Exception as exc:  # the turn is lost, the session goes on
            log.warning("transcribing %s failed: %s", item.id, exc)
            error = {"type": "server_error", "code": "transcription_failed", "message": str(exc), "param": None}
            self.send(server_event("conversation.item.input_audio_transcription.failed", item_id=item.id,
                                   content_index=0, error=error))
            item.text = ""
        else:
            item.text = result.text.strip()
            if self.config.type == "transcription":
                self.send(server_event("conversation.item.input_audio_transcription.delta", item_id=item.id,
                                       content_index=0, delta=item.text))
            usage = {"type": "duration", "seconds": round(len(pcm) / 2 / API_RATE, 3)}
            self.send(server_event("conversation.item.input_audio_transcription.completed", item_id=item.id,
                                   content_index=0, transcript=item.text, usage=usage))
        item.status = "completed"
        self.send(server_event("conversation.item.done", item=item.json(), previous_item_id=previous))

    # ------------------------------------------------------------------ conversation

    def _create_item(self, event: ConversationItemCreate) -> None:
        item = event.item
        part = item.content[0]
        if len(item.content) > 1:
            raise ClientEventError("item.content: one content part per item", "item.content", "invalid_value",
                                   event.event_id)
        item_id = item.id or new_id("item")
        if any(known.id == item_id for known in self.items):
            raise ClientEventError(f"item.id: {item_id!r} is already in the conversation", "item.id",
                                   "item_already_exists", event.event_id)
        previous = self.items[-1].id if self.items else None
        if part.type == "input_audio" and part.transcript is None:
            if item.role != "user":
                raise ClientEventError("item.content[0].type: only a user's item holds input_audio",
                                       "item.content[0].type", "invalid_value", event.event_id)
            pcm = _b64_audio(part.audio or "", "item.content[0].audio")
            self._add_audio_item(Item(item_id, "user", "input_audio", None, "in_progress"), pcm, previous)
            return
        text = part.text if part.text is not None else part.transcript
        if text is None:
            raise ClientEventError("item.content[0].text: the part holds no text", "item.content[0].text",
                                   "invalid_value", event.event_id)
        kind = {"user": "input_text", "system": "input_text", "assistant": "output_text"}[item.role]
        stored = Item(item_id, item.role, kind, text)
        self.items.append(stored)
        self.send(server_event("conversation.item.added", item=stored.json(), previous_item_id=previous))
        self.send(server_event("conversation.item.done", item=stored.json(), previous_item_id=previous))

    def _chat_spec(self, request_id: str, overrides: ResponseOverrides) -> ChatSpec:
        """The conversation so far as chat messages, the instructions as the system message."""
        instructions = overrides.instructions if overrides.instructions is not None else self.config.instructions
        messages = [{"role": "system", "content": instructions}] if instructions else []
        messages += [{"role": item.role, "content": item.text} for item in self.items if item.text]
        limit = overrides.max_output_tokens or self.config.max_output_tokens
        return ChatSpec(request_id=request_id, messages=messages, sampling=SamplingParams(),
                        max_tokens=None if limit == "inf" else int(limit))

    # ------------------------------------------------------------------ responses

    def _create_response(self, overrides: ResponseOverrides) -> None:
        if self.config.type == "transcription":
            raise ClientEventError("a transcription session makes no responses: its turns are transcribed", None,
                                   "invalid_session_type")
        if self._response is not None:
            raise ClientEventError(f"the conversation already has an active response ({self._response.id})", None,
                                   "conversation_already_has_active_response")
        voice = overrides.audio.output.voice if overrides.audio and overrides.audio.output else None
        self._check_voice(voice, "response.audio.output.voice")
        self._start_response(overrides)

    def _cancel_by_client(self, event: ResponseCancel) -> None:
        current = self._response
        if current is None or (event.response_id is not None and event.response_id != current.id):
            which = f" {event.response_id!r}" if event.response_id else ""
            raise ClientEventError(f"no active response{which} to cancel", "response_id" if which else None,
                                   "response_cancel_not_active", event.event_id)
        self._cancel_response("client_cancelled")

    def _cancel_response(self, reason: str) -> None:
        current = self._response
        if current is not None and current.task is not None and not current.task.done() and current.reason is None:
            current.reason = reason
            current.task.cancel()

    def _start_response(self, overrides: ResponseOverrides) -> None:
        response = _Response(new_id("resp"))
        response.task = asyncio.get_running_loop().create_task(self._respond(response, overrides))
        self._response = response

    async def _respond(self, response: _Response, overrides: ResponseOverrides) -> None:
        modalities = overrides.output_modalities or self.config.output_modalities
        audio = modalities == ["audio"]
        voice = (overrides.audio.output.voice if overrides.audio and overrides.audio.output else None) \
            or self.config.audio.output.voice
        reply = Reply(response.id, new_id("item"), audio, self.send)
        header = {"id": response.id, "object": "realtime.response", "output_modalities": modalities,
                  "audio": {"output": {"format": {"type": "audio/pcm", "rate": API_RATE}, "voice": voice}}}
        self.send(server_event("response.created", response={**header, "status": "in_progress", "output": []}))
        status, details, usage = "completed", None, None
        try:
            if self._transcribing:  # the turns it answers, read (``wait``: cancelling us spares them)
                await asyncio.wait(set(self._transcribing))
            spec = self._chat_spec(response.id, overrides)
            reply.open(self.items[-1].id if self.items else None)
            usage = await reply.stream(self.backend.respond(spec, voice=voice, audio=audio), self.backend.sample_rate)
            if reply.finish_reason == "length":  # cut at max_output_tokens
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            status, details = "cancelled", {"type": "cancelled", "reason": response.reason or "client_cancelled"}
        except Exception as exc:  # the response fails, the session goes on
            log.warning("response %s failed: %s", response.id, exc)
            kind = "invalid_request_error" if isinstance(exc, RequestError) else "server_error"
            status, details = "failed", {"type": "failed", "error": {"type": kind, "message": str(exc)}}
        item = reply.close(status)
        if item is not None and (item.text or status in ("completed", "incomplete")):
            self.items.append(item)
        done = {**header, "status": status, "status_details": details,
                "output": [item.json()] if item is not None else [], "usage": usage}
        self.send(server_event("response.done", response=done))
        self._response = None
