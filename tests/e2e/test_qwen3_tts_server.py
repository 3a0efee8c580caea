"""Qwen3-TTS over HTTP: a real ``mstar serve qwen3_tts`` on a tiny dummy checkpoint (the talker
and the codec on one worker), driven by the official ``openai`` client: plain and streamed
speech (seeded: the streamed chunks join to the whole), 8 concurrent requests equal to their
solo audio, the voices, and bad input refused with a 400 naming the field."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf
from live_server import launch_server
from openai import OpenAI

from tests.support.qwen3_tts_dir import SAMPLES_PER_FRAME, deployment_yaml, eager_pcm, write_checkpoint

TIMEOUT_S = 120.0
FRAMES = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_tts_ckpt"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    work = tmp_path_factory.mktemp("qwen3_tts")
    (work / "qwen3_tts.yaml").write_text(deployment_yaml("qwen3_tts", checkpoint))
    with launch_server("qwen3_tts", work, ["--config", str(work / "qwen3_tts.yaml")]) as live:
        yield live


def test_greedy_audio_equals_the_eager_loop(server, checkpoint) -> None:
    """Greedy (temperature 0): the served audio is ``eager_pcm``'s, to the int16 step."""
    expected = eager_pcm(checkpoint, "Hello there.", FRAMES)
    served = np.frombuffer(speak(server, "Hello there.", 0, temperature=0.0), "<i2").astype(int)
    assert served.shape == expected.shape and np.abs(served - expected).max() <= 2
    assert np.abs(served).max() > 100  # not silence


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


def speak(server, text: str, seed: int, **extra) -> bytes:
    body = {"seed": seed, "max_tokens": FRAMES, **extra}
    return client(server).audio.speech.create(model="qwen3_tts", voice="vivian", input=text, response_format="pcm",
                                              extra_body=body).content


def test_speech_plain_and_streamed(server) -> None:
    extra = {"seed": 3, "max_tokens": FRAMES}
    audio = client(server).audio.speech.create(model="qwen3_tts", voice="vivian", input="Hello there.",
                                               response_format="wav", extra_body=extra)
    samples, rate = sf.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == 24000 and samples.ndim == 1 and 0 < samples.size <= FRAMES * SAMPLES_PER_FRAME
    assert samples.size % SAMPLES_PER_FRAME == 0 and np.abs(samples).max() > 0
    whole = speak(server, "Hello there.", 3)
    with client(server).audio.speech.with_streaming_response.create(
            model="qwen3_tts", voice="vivian", input="Hello there.", response_format="pcm",
            extra_body={**extra, "stream": True}) as response:
        chunks = list(response.iter_bytes())
    assert b"".join(chunks) == whole == samples.tobytes()


def test_concurrent_requests_equal_their_solo_audio(server) -> None:
    texts = [f"Sentence number {i}." for i in range(8)]
    solo = [speak(server, t, 10 + i) for i, t in enumerate(texts)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: speak(server, texts[i], 10 + i), range(8)))
    # the same codes; batched float maths may move a sample by a step of int16
    for a, b in zip(together, solo):
        x, y = np.frombuffer(a, "<i2").astype(int), np.frombuffer(b, "<i2").astype(int)
        assert x.shape == y.shape and np.abs(x - y).max() <= 2, np.abs(x - y).max()
    assert len(set(solo)) > 1


def test_instructions_and_voices(server) -> None:
    # greedy: seeded draws on the tiny random talker's near-flat logits are decided by the shared
    # noise, so the same seed could speak the same codes with or without the instruction
    plain = speak(server, "Hi.", 5, temperature=0.0)
    styled = client(server).audio.speech.create(model="qwen3_tts", voice="vivian", input="Hi.", response_format="pcm",
                                                instructions="Speak softly.",
                                                extra_body={"seed": 5, "max_tokens": FRAMES,
                                                            "temperature": 0.0}).content
    assert styled != plain
    voices = httpx.get(f"{server.url}/v1/audio/voices", params={"model": "qwen3_tts"}).json()
    assert "vivian" in str(voices) and "ryan" in str(voices)


@pytest.mark.parametrize(("body", "field"), [
    ({"voice": "nobody"}, "voice"),
    ({"voice": "vivian", "speed": 2.0}, "speed"),
    ({"voice": "vivian", "input": ""}, "input"),
    ({"voice": "vivian", "language": "klingon"}, "language"),
    ({"voice": "vivian", "ref_audio": "not audio"}, "ref_audio"),
    ({"voice": "vivian", "ref_audio": "data:audio/wav;base64,UklGRg=="}, "ref_audio"),
])
def test_bad_inputs_get_a_400_naming_the_field(server, body, field) -> None:
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "qwen3_tts", "input": "Hi.", **body},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400 and field in r.text, (r.status_code, r.text)
