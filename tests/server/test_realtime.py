"""/v1/realtime driven by the official ``openai`` client (``AsyncOpenAI.realtime.connect``)
and by our SDK, against uvicorn serving a fake ``RespondingBackend``.

Every server event read is also parsed with the ``openai`` package's own event types, so
their shapes are the GA API's. The audio turns use a real speech clip
(tests/data/speech_en.wav, upsampled to the API's 24 kHz): Silero VAD does not hear speech
in synthetic noise.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import websockets
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter
from scipy.signal import resample_poly

from mstar.client import MStarClient, MStarError
from mstar.contract import ChatSpec, OutputEvent, Transcription, TranscriptionSpec
from mstar.server.app import create_app
from tests.support.fake_backend import LiveServer, wait_until

MODEL = "fake-voice"
KEY = "sk-realtime-test"
REPLY = ["Hello", " there.", " How", " are", " you?"]
HEARD = "what is the capital of france"
CHUNK_S = 0.05  # seconds of audio per reply piece
SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
CLIP = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"


class FakeVoiceBackend:
    """A RespondingBackend: ``transcribe`` hears ``HEARD`` in any audio; ``respond`` streams
    ``REPLY`` word by word, each with ``CHUNK_S`` of a tone at 22.05 kHz (piper's rate). A
    last user message holding "forever" streams until closed. ``cancelled`` is set when a
    reply's iterator is closed before its end."""

    model_id = MODEL
    max_model_len = 4096
    sample_rate = 22050

    def __init__(self) -> None:
        self.tasks = frozenset({"realtime", "transcription"})
        self.specs: list[tuple[ChatSpec, str | None, bool]] = []
        self.heard: list[float] = []  # seconds of each transcribed clip
        self.heard_rates: list[int] = []
        self.heard_at: list[float] = []  # when each transcription was asked for (perf_counter)
        self.cancelled = asyncio.Event()
        self.finished = 0

    def healthy(self) -> bool:
        return True

    def voices(self) -> list[str]:
        return ["joe", "amy"]

    async def transcribe(self, spec: TranscriptionSpec) -> Transcription:
        self.heard_at.append(time.perf_counter())
        pcm, rate = sf.read(io.BytesIO(spec.audio), dtype="float32")
        self.heard.append(len(pcm) / rate)
        self.heard_rates.append(rate)
        return Transcription(text=f" {HEARD} ", language="en", duration=len(pcm) / rate)

    async def respond(self, spec: ChatSpec, *, voice: str | None = None,
                      audio: bool = True) -> AsyncIterator[OutputEvent]:
        self.specs.append((spec, voice, audio))
        forever = "forever" in str(spec.messages[-1]["content"])
        tone = (0.3 * np.sin(np.arange(int(CHUNK_S * self.sample_rate)) * 0.05)).astype("<f4").tobytes()
        ended = False
        words = len(REPLY) if spec.max_tokens is None else min(len(REPLY), spec.max_tokens)
        try:
            for i in range(10_000 if forever else words):
                yield OutputEvent(text=REPLY[i % len(REPLY)], completion_tokens=i + 1, prompt_tokens=7)
                if audio:
                    yield OutputEvent(modality="audio", data=tone)
                await asyncio.sleep(0.02)
            yield OutputEvent(finish_reason="stop" if words == len(REPLY) else "length", prompt_tokens=7,
                              completion_tokens=words)
            ended = True
            self.finished += 1
        finally:
            if not ended:
                self.cancelled.set()


@pytest.fixture(scope="module")
def backend() -> FakeVoiceBackend:
    return FakeVoiceBackend()


@pytest.fixture(scope="module")
def server(backend: FakeVoiceBackend) -> Iterator[LiveServer]:
    with LiveServer(create_app(backend, served_model_names=[MODEL], api_key=KEY)) as live:  # type: ignore[arg-type]
        yield live


@pytest.fixture(scope="module")
def speech_24k() -> np.ndarray:
    """The first sentence of the clip (up to a long pause) then 1.2 s of silence, PCM16 24 kHz."""
    pcm, rate = sf.read(CLIP, dtype="float32")
    assert rate == 16000
    first = pcm[: int(3.6 * rate)]
    audio = np.concatenate([np.zeros(int(0.5 * rate), np.float32), first, np.zeros(int(1.2 * rate), np.float32)])
    return resample_poly(audio, 3, 2).astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def client(server: LiveServer, key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key)


async def recv(conn: Any) -> dict[str, Any]:
    """The next server event as JSON, checked against the openai package's event types."""
    data = json.loads(await conn.recv_bytes())
    SERVER_EVENT.validate_python(data)
    return data


async def until(conn: Any, kind: str) -> list[dict[str, Any]]:
    """Events up to and including the first of type ``kind``."""
    events = []
    while True:
        events.append(await recv(conn))
        if events[-1]["type"] == kind:
            return events


async def send_user_text(conn: Any, text: str) -> None:
    await conn.send({"type": "conversation.item.create",
                     "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


async def append_audio(conn: Any, samples: np.ndarray, piece_s: float = 0.1) -> None:
    step = int(piece_s * 24000)
    for i in range(0, len(samples), step):
        await conn.send({"type": "input_audio_buffer.append",
                         "audio": base64.b64encode(pcm16(samples[i:i + step])).decode()})


NO_VAD = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}


def test_session_created_then_updated(server: LiveServer) -> None:
    async def main() -> None:
        async with client(server).realtime.connect(model=MODEL) as conn:
            created = await recv(conn)
            assert created["type"] == "session.created"
            session = created["session"]
            assert session["type"] == "realtime" and session["model"] == MODEL
            assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
            assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
            await conn.session.update(session={
                "type": "realtime", "instructions": "Be brief.", "output_modalities": ["text"],
                "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.6,
                                                       "silence_duration_ms": 300}},
                          "output": {"voice": "amy"}}})
            updated = (await recv(conn))["session"]
            assert updated["instructions"] == "Be brief." and updated["output_modalities"] == ["text"]
            detection = updated["audio"]["input"]["turn_detection"]
            assert (detection["threshold"], detection["silence_duration_ms"], detection["prefix_padding_ms"]) \
                == (0.6, 300, 300)
            assert updated["audio"]["output"]["voice"] == "amy"
            await conn.session.update(session=NO_VAD)
            assert (await recv(conn))["session"]["audio"]["input"]["turn_detection"] is None

    run(main())


def test_text_turn_streams_audio_and_transcript(server: LiveServer, backend: FakeVoiceBackend) -> None:
    async def main() -> list[dict[str, Any]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={**NO_VAD, "instructions": "You are terse.",
                                               "audio": {**NO_VAD["audio"], "output": {"voice": "joe"}}})
            await recv(conn)
            await send_user_text(conn, "Hi there")
            await conn.send({"type": "response.create"})
            return await until(conn, "response.done")

    backend.specs.clear()
    events = run(main())
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["conversation.item.added", "conversation.item.done", "response.created"]
    assert kinds[3:6] == ["response.output_item.added", "conversation.item.added", "response.content_part.added"]
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"]
    assert deltas == REPLY
    # each word's transcript delta comes before that word's audio
    first_audio = kinds.index("response.output_audio.delta")
    assert kinds.index("response.output_audio_transcript.delta") < first_audio
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    samples_in = len(REPLY) * int(CHUNK_S * 22050)
    assert len(audio) // 2 == -(-samples_in * 24000 // 22050)  # resampled to 24 kHz, tail flushed
    tone = np.frombuffer(audio, "<i2")
    assert 0.25 * 32767 < np.abs(tone[1000:-1000]).max() < 0.35 * 32767
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0] == {"type": "output_audio", "transcript": "".join(REPLY)}
    assert done["usage"] == {"input_tokens": 7, "output_tokens": len(REPLY), "total_tokens": 7 + len(REPLY)}
    spec, voice, wants_audio = backend.specs[-1]
    assert spec.messages == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    assert voice == "joe" and wants_audio


def test_text_modality_and_the_conversation_grows(server: LiveServer, backend: FakeVoiceBackend) -> None:
    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={**NO_VAD, "output_modalities": ["text"]})
            await recv(conn)
            await send_user_text(conn, "One")
            await conn.send({"type": "response.create"})
            first = await until(conn, "response.done")
            await send_user_text(conn, "Two")
            await conn.send({"type": "response.create", "response": {"instructions": "Override.",
                                                                     "max_output_tokens": 2}})
            return first, await until(conn, "response.done")

    backend.specs.clear()
    first, second = run(main())
    kinds = [e["type"] for e in first]
    assert "response.output_audio.delta" not in kinds
    assert [e["delta"] for e in first if e["type"] == "response.output_text.delta"] == REPLY
    assert next(e for e in first if e["type"] == "response.output_text.done")["text"] == "".join(REPLY)
    cut = second[-1]["response"]
    assert (cut["status"], cut["status_details"]) == ("incomplete", {"type": "incomplete",
                                                                     "reason": "max_output_tokens"})
    assert cut["output"][0]["content"][0]["text"] == "".join(REPLY[:2])
    spec, _, wants_audio = backend.specs[-1]
    assert not wants_audio and spec.max_tokens == 2
    assert spec.messages == [{"role": "system", "content": "Override."}, {"role": "user", "content": "One"},
                             {"role": "assistant", "content": "".join(REPLY)}, {"role": "user", "content": "Two"}]


def test_server_vad_turn_is_transcribed_and_answered(
        server: LiveServer, backend: FakeVoiceBackend, speech_24k: np.ndarray) -> None:
    async def main() -> list[dict[str, Any]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 500, "prefix_padding_ms": 300},
                "transcription": {"model": "whisper-1"}}}})
            await recv(conn)
            await append_audio(conn, speech_24k)
            return await until(conn, "response.done")

    backend.specs.clear()
    backend.heard.clear()
    events = run(main())
    kinds = [e["type"] for e in events]
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
             "response.created", "response.output_audio.delta", "response.done"]
    assert all(k in kinds for k in order)
    assert sorted(order, key=kinds.index) == order
    assert kinds.count("input_audio_buffer.speech_started") == 1
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    # the clip's speech begins at 0.5 s (its own leading quiet aside) and ends by 4.1 s
    assert 0 <= started["audio_start_ms"] <= 500 + 300
    assert 1500 <= stopped["audio_end_ms"] <= 4100 + 100
    item_id = started["item_id"]
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert committed["item_id"] == stopped["item_id"] == completed["item_id"] == item_id
    assert completed["transcript"] == HEARD
    # the committed audio runs from the padded start to the end of speech, at 24 kHz
    assert backend.heard_rates[-1] == 24000
    assert backend.heard[-1] == pytest.approx((stopped["audio_end_ms"] - started["audio_start_ms"]) / 1000, abs=0.05)
    assert backend.specs[-1][0].messages == [{"role": "user", "content": HEARD}]
    assert events[-1]["response"]["status"] == "completed"


def test_the_turn_is_read_in_the_pause_that_ends_it(
        server: LiveServer, backend: FakeVoiceBackend, speech_24k: np.ndarray) -> None:
    """With 500 ms of silence to end a turn, its transcription starts 200 ms into that silence:
    by speech_stopped the turn is already being read, and not read again."""
    async def main() -> tuple[list[dict[str, Any]], float]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
            await recv(conn)
            async def send() -> None:  # in real time, as a microphone would
                for i in range(0, len(speech_24k), 2400):
                    await append_audio(conn, speech_24k[i:i + 2400])
                    await asyncio.sleep(0.1)

            sending = asyncio.create_task(send())
            events = await until(conn, "input_audio_buffer.speech_stopped")
            stopped_at = time.perf_counter()
            events += await until(conn, "response.done")
            await sending
            return events, stopped_at

    backend.heard.clear()
    backend.heard_at.clear()
    events, stopped_at = run(main())
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    turn_s = (stopped["audio_end_ms"] - started["audio_start_ms"]) / 1000
    reads = [at for at, heard in zip(backend.heard_at, backend.heard, strict=True) if abs(heard - turn_s) < 0.05]
    # read once, ~300 ms (of the 500 ms silence) before the turn was declared over
    assert len(reads) == 1 and reads[0] < stopped_at - 0.15
    done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert done["transcript"] == HEARD and events[-1]["response"]["status"] == "completed"


def test_barge_in_cancels_the_reply(server: LiveServer, backend: FakeVoiceBackend, speech_24k: np.ndarray) -> None:
    async def main() -> tuple[list[dict[str, Any]], float]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                "type": "server_vad", "create_response": False}}}})
            await recv(conn)
            await send_user_text(conn, "Talk forever")
            await conn.send({"type": "response.create"})
            await until(conn, "response.output_audio.delta")
            assert not backend.cancelled.is_set()
            await append_audio(conn, speech_24k[: 24000 * 2])
            events = await until(conn, "input_audio_buffer.speech_started")
            heard_at = time.monotonic()
            events += await until(conn, "response.done")
            return events, time.monotonic() - heard_at

    backend.cancelled.clear()
    events, latency = run(main())
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert done["output"][0]["status"] == "incomplete" and done["output"][0]["content"][0]["transcript"]
    assert backend.cancelled.is_set()  # the respond iterator was closed
    print(f"barge-in: response.done {1000 * latency:.0f} ms after speech_started reached the client")


def test_response_cancel_then_the_session_goes_on(server: LiveServer, backend: FakeVoiceBackend) -> None:
    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session=NO_VAD)
            await recv(conn)
            await send_user_text(conn, "forever please")
            await conn.send({"type": "response.create"})
            await until(conn, "response.output_audio_transcript.delta")
            await conn.send({"type": "response.create", "event_id": "again"})
            busy = await until(conn, "error")
            await conn.send({"type": "response.cancel"})
            cancelled = await until(conn, "response.done")
            await conn.send({"type": "response.cancel", "event_id": "nothing"})
            idle = (await until(conn, "error"))[-1]
            await send_user_text(conn, "short now")
            await conn.send({"type": "response.create"})
            return cancelled, await until(conn, "response.done"), {"busy": busy[-1], "idle": idle}

    backend.cancelled.clear()
    cancelled, after, errors = run(main())
    assert cancelled[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    assert backend.cancelled.is_set()
    assert errors["busy"]["error"]["code"] == "conversation_already_has_active_response"
    assert errors["busy"]["error"]["event_id"] == "again"
    assert errors["idle"]["error"]["code"] == "response_cancel_not_active"
    assert errors["idle"]["error"]["event_id"] == "nothing"
    assert after[-1]["response"]["status"] == "completed"


def test_disconnect_cancels_the_reply(server: LiveServer, backend: FakeVoiceBackend) -> None:
    async def main() -> None:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session=NO_VAD)
            await recv(conn)
            await send_user_text(conn, "forever and ever")
            await conn.send({"type": "response.create"})
            await until(conn, "response.output_audio.delta")

    backend.cancelled.clear()
    run(main())
    assert wait_until(backend.cancelled.is_set)


@pytest.mark.parametrize(("frame", "param", "code"), [
    ("{not json", None, "invalid_json"),
    (json.dumps({"type": "session.teleport", "event_id": "e1"}), "type", "invalid_event_type"),
    (json.dumps({"type": "session.update", "event_id": "e2", "session": {"audio": {"input": {
        "turn_detection": {"type": "server_vad", "threshold": 1.5}}}}}),
     "session.audio.input.turn_detection.threshold", "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}}),
     "session.audio.input.format.type", "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"output_modalities": ["audio", "text"]}}),
     "session.output_modalities", "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}}),
     "session.audio.output.voice", "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}), "audio", "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.append"}), "audio", "invalid_value"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": []}}),
     "item.content", "invalid_value"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "robot",
                                                              "content": [{"type": "input_text", "text": "x"}]}}),
     "item.role", "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.commit"}), None, "input_audio_buffer_commit_empty"),
])
def test_bad_events_get_an_error_naming_the_field(server: LiveServer, frame: str, param: str | None,
                                                  code: str) -> None:
    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.send_raw(frame)  # as it is: the client would refuse to build some of these
            error = await recv(conn)
            await conn.session.update(session={"type": "realtime", "instructions": "still here"})
            return error, await recv(conn)

    error, after = run(main())
    assert error["type"] == "error"
    assert error["error"]["param"] == param and error["error"]["code"] == code
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    if '"event_id"' in frame:
        assert error["error"]["event_id"] == json.loads(frame)["event_id"]
    assert after["type"] == "session.updated" and after["session"]["instructions"] == "still here"


async def _refused(url: str, key: str = KEY) -> tuple[dict[str, Any], int | None, str]:
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as socket:
        event = json.loads(await socket.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await socket.recv()
        return event, socket.close_code, socket.close_reason or ""


def test_refused_connections_say_why(server: LiveServer, backend: FakeVoiceBackend) -> None:
    ws = server.url.replace("http", "ws") + "/v1/realtime"
    event, code, reason = run(_refused(f"{ws}?model=nope"))
    assert event["error"]["param"] == "model" and event["error"]["code"] == "model_not_found"
    assert code == 1008 and "nope" in reason
    event, code, reason = run(_refused(ws, key="wrong"))
    assert event["error"]["code"] == "invalid_api_key" and code == 1008
    backend.tasks = frozenset({"transcription"})
    try:
        event, code, reason = run(_refused(f"{ws}?model={MODEL}"))
    finally:
        backend.tasks = frozenset({"realtime", "transcription"})
    assert event["error"]["param"] == "model" and event["error"]["code"] == "model_not_supported"
    assert code == 1008 and "realtime" in reason


def test_openai_client_sees_a_bad_model_as_an_error(server: LiveServer) -> None:
    async def main() -> dict[str, Any]:
        async with client(server).realtime.connect(model="nope") as conn:
            return await recv(conn)

    assert run(main())["error"]["param"] == "model"


def test_sdk_realtime(server: LiveServer) -> None:
    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        sdk = MStarClient(server.url, api_key=KEY)
        async with sdk.realtime(model=MODEL, session={"output_modalities": ["text"], **NO_VAD}) as conn:
            session = conn.session
            await conn.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
            await conn.send({"type": "response.create"})
            events = []
            async for event in conn:
                events.append(event)
                if event["type"] == "response.done":
                    break
        return session, events

    session, events = run(main())
    assert session["output_modalities"] == ["text"] and session["audio"]["input"]["turn_detection"] is None
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "".join(REPLY)
    assert events[-1]["response"]["status"] == "completed"


def test_sdk_realtime_refused(server: LiveServer) -> None:
    async def main() -> None:
        async with MStarClient(server.url, api_key="wrong").realtime():
            pass

    with pytest.raises(MStarError) as info:
        run(main())
    assert info.value.status == 401


def test_commit_by_hand_then_response(server: LiveServer, backend: FakeVoiceBackend,
                                      speech_24k: np.ndarray) -> None:
    async def main() -> list[dict[str, Any]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session=NO_VAD)
            await recv(conn)
            await append_audio(conn, speech_24k[: 24000])
            await conn.send({"type": "input_audio_buffer.commit"})
            await conn.send({"type": "response.create"})  # before the transcript is back: it waits for it
            return await until(conn, "response.done")

    backend.specs.clear()
    events = run(main())
    kinds = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" not in kinds
    assert kinds.index("input_audio_buffer.committed") < kinds.index(
        "conversation.item.input_audio_transcription.completed") < kinds.index("response.output_item.added")
    assert backend.heard[-1] == pytest.approx(1.0)
    assert backend.specs[-1][0].messages == [{"role": "user", "content": HEARD}]


def test_without_silero_the_session_goes_on_without_vad() -> None:
    from mstar.server.realtime.session import RealtimeSession
    from mstar.server.realtime.vad import VadHub

    def missing() -> object:
        raise ModuleNotFoundError("No module named 'silero_vad'")

    async def main() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        session = RealtimeSession(FakeVoiceBackend(), sent.append, VadHub(load=missing), MODEL)  # type: ignore[arg-type]
        await session.start()
        await session.handle(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(
            bytes(4800)).decode()}))
        await session.close()
        return sent

    sent = run(main())
    assert [e["type"] for e in sent] == ["error", "session.created"]
    assert sent[0]["error"]["param"] == "session.audio.input.turn_detection"
    assert sent[1]["session"]["audio"]["input"]["turn_detection"] is None


def test_a_failure_of_ours_is_an_error_event_and_the_session_goes_on() -> None:
    from mstar.server.realtime.session import RealtimeSession
    from mstar.server.realtime.vad import VadHub

    class Broken(FakeVoiceBackend):
        def voices(self) -> list[str]:
            raise RuntimeError("voice table unreadable")

    async def main() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        session = RealtimeSession(Broken(), sent.append, VadHub(), MODEL)  # type: ignore[arg-type]
        session.config = session.config.model_copy(update={"audio": session.config.audio.model_copy(update={
            "input": session.config.audio.input.model_copy(update={"turn_detection": None})})})
        await session.handle(json.dumps({"type": "session.update", "event_id": "v",
                                         "session": {"audio": {"output": {"voice": "joe"}}}}))
        await session.handle(json.dumps({"type": "session.update", "session": {"instructions": "ok"}}))
        await session.close()
        return sent

    sent = run(main())
    assert [e["type"] for e in sent] == ["error", "session.updated"]
    assert sent[0]["error"]["type"] == "server_error" and sent[0]["error"]["event_id"] == "v"
    assert "voice table unreadable" in sent[0]["error"]["message"]


def test_two_sessions_share_the_vad(server: LiveServer, backend: FakeVoiceBackend, speech_24k: np.ndarray) -> None:
    """Both sessions' audio is judged by the one network (batched when both have chunks
    waiting); each hears its own turn, at the same place of its own stream."""

    async def one(lead_silence_s: float) -> list[dict[str, Any]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            await recv(conn)
            audio = np.concatenate([np.zeros(int(lead_silence_s * 24000), np.float32), speech_24k])
            await append_audio(conn, audio)
            return await until(conn, "response.done")

    async def main() -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(one(0.0), one(1.0)))

    first, second = run(main())
    starts = [next(e["audio_start_ms"] for e in events if e["type"] == "input_audio_buffer.speech_started")
              for events in (first, second)]
    assert abs((starts[1] - starts[0]) - 1000) <= 64  # the second stream's speech is 1 s later
    assert first[-1]["response"]["status"] == second[-1]["response"]["status"] == "completed"


def test_a_browser_sends_the_key_as_a_subprotocol(server: LiveServer) -> None:
    """A browser cannot set headers on a WebSocket: OpenAI's browser clients offer
    ``realtime`` and ``openai-insecure-api-key.KEY``; the server picks ``realtime`` (a browser
    fails a handshake that picks none) and reads the key from the other."""
    ws = server.url.replace("http", "ws") + "/v1/realtime"

    async def main(key: str) -> tuple[str | None, dict[str, Any]]:
        protocols = ["realtime", f"openai-insecure-api-key.{key}"]
        async with websockets.connect(ws, subprotocols=protocols) as socket:  # type: ignore[arg-type]
            return socket.subprotocol, json.loads(await socket.recv())

    chosen, event = run(main(KEY))
    assert chosen == "realtime" and event["type"] == "session.created"
    chosen, event = run(main("wrong"))
    assert event["type"] == "error" and event["error"]["code"] == "invalid_api_key"
