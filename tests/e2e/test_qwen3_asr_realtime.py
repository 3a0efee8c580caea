"""End to end: ``mstar serve qwen3_asr_realtime`` (the real CLI in a subprocess, a tiny
released-layout checkpoint, dummy weights) over ``/v1/realtime`` with the official ``openai``
client: the session is a transcription session; ``input_audio_buffer.append`` then a commit
give the transcript as a delta, then completed, equal to what /v1/audio/transcriptions gives
for the same audio (language forced in the session, as in the request); a transcription
session makes no responses and cannot become a conversation; a socket closed while its turn
is being transcribed frees every KV page and request. Every server event is parsed with the
``openai`` package's own event types."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from live_server import Server, serve_offline
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from tests.support.qwen3_asr import write_hub

MODEL = "qwen3_asr_realtime"
SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
CONFIG = {"model": MODEL, "load_format": "dummy", "max_seq_len": 16384, "max_concurrent_requests": 4,
          "resources": {"kv_cache": {"max_num_pages": 4096, "page_size": 16}},
          "model_kwargs": {"max_new_tokens": 6}}
SESSION = {"type": "transcription",
           "audio": {"input": {"turn_detection": None, "transcription": {"language": "de"}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    hub = tmp_path_factory.mktemp("hub")
    write_hub(hub, "Qwen/Qwen3-ASR-0.6B", seed=1)
    with serve_offline(MODEL, tmp_path_factory.mktemp("server"), CONFIG | {"cache_dir": str(hub)}) as live:
        yield live


def noise_24k(seconds: float, seed: int) -> np.ndarray:
    return (0.2 * np.random.default_rng(seed).standard_normal(int(seconds * 24000))).astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


async def recv(conn: Any) -> dict[str, Any]:
    data = json.loads(await conn.recv_bytes())
    SERVER_EVENT.validate_python(data)
    return data


async def until(conn: Any, kind: str) -> list[dict[str, Any]]:
    events = []
    while True:
        events.append(await recv(conn))
        if events[-1]["type"] == kind:
            return events


async def append(conn: Any, samples: np.ndarray, piece_s: float = 0.5) -> None:
    step = int(piece_s * 24000)
    for i in range(0, len(samples), step):
        await conn.send({"type": "input_audio_buffer.append",
                         "audio": base64.b64encode(pcm16(samples[i:i + step])).decode()})


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")


def in_use(http: httpx.Client) -> tuple[float, ...]:
    text = http.get("/metrics").text
    pages = float(re.search(r'^mstar_kv_pages_used\{[^}]*node="decoder"[^}]*\} (\S+)$', text, re.M).group(1))
    live = [float(m) for m in re.findall(r"^mstar_requests_(?:running|waiting) (\S+)$", text, re.M)]
    return pages, sum(live)


def test_appended_audio_is_transcribed_as_delta_then_completed(server: Server, http: httpx.Client) -> None:
    audio = noise_24k(1.5, seed=3)

    async def session() -> tuple[dict, list[dict]]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            created = (await until(conn, "session.created"))[-1]
            await conn.send({"type": "session.update", "session": SESSION})
            await until(conn, "session.updated")
            await append(conn, audio)
            await conn.send({"type": "input_audio_buffer.commit"})
            return created, await until(conn, "conversation.item.done")

    created, events = run(session())
    assert created["session"]["type"] == "transcription"
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.committed") < kinds.index(
        "conversation.item.input_audio_transcription.delta") < kinds.index(
        "conversation.item.input_audio_transcription.completed")
    deltas = "".join(e["delta"] for e in events if e["type"].endswith("transcription.delta"))
    completed = next(e for e in events if e["type"].endswith("transcription.completed"))
    assert deltas == completed["transcript"] and completed["transcript"]
    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(pcm16(audio), "<i2"), 24000, format="WAV", subtype="PCM_16")
    alone = http.post("/v1/audio/transcriptions", data={"model": MODEL, "language": "de"},
                      files={"file": ("turn.wav", wav.getvalue(), "audio/wav")})
    assert alone.status_code == 200, alone.text
    assert alone.json()["text"] == completed["transcript"]


def test_a_transcription_session_makes_no_responses(server: Server) -> None:
    async def session() -> tuple[dict, dict]:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.send({"type": "response.create"})
            refused = (await until(conn, "error"))[-1]
            await conn.send({"type": "session.update", "session": {"type": "realtime"}})
            return refused, (await until(conn, "error"))[-1]

    refused, converse = run(session())
    assert refused["error"]["code"] == "invalid_session_type"
    assert converse["error"]["param"] == "session.type"


def test_closing_the_socket_mid_transcription_frees_its_state(server: Server, http: httpx.Client) -> None:
    """The socket closes once the turn's walk holds KV pages; then every page and request is
    given back."""

    async def session() -> None:
        async with client(server).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.send({"type": "session.update", "session": SESSION})
            await until(conn, "session.updated")
            await append(conn, noise_24k(300.0, seed=4), piece_s=2.0)
            await conn.send({"type": "input_audio_buffer.commit"})
            await until(conn, "input_audio_buffer.committed")
            deadline = time.monotonic() + 20
            while not (await asyncio.to_thread(in_use, http))[0]:
                assert time.monotonic() < deadline, "the turn's transcription never held KV pages"
                await asyncio.sleep(0.01)

    run(session())
    deadline = time.monotonic() + 30
    while any(state := in_use(http)):
        assert time.monotonic() < deadline, f"pages / requests still held: {state}"
        time.sleep(0.1)
