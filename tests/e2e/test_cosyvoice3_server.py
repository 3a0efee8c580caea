"""CosyVoice3 over HTTP: a real ``mstar serve`` (the LM and the vocoder on two workers, speech
tokens streamed between them) on tiny dummy weights, driven by the official ``openai`` client.
Every request clones: an uploaded ``ref_audio`` clip or a preset of ``voices_dir``."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import soundfile as sf
from live_server import launch_server
from openai import OpenAI

REQUEST_TIMEOUT_S = 120.0


def clip_wav(seconds: float = 1.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (150 + 30 * np.sin(2 * np.pi * 3 * t)) * t)
    out = io.BytesIO()
    sf.write(out, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("cosyvoice3")
    voices = work / "voices"
    voices.mkdir()
    (voices / "anna.wav").write_bytes(clip_wav(1.2))
    (voices / "anna.txt").write_text("A short clip.")
    (work / "cosyvoice3.yaml").write_text(
        "model: cosyvoice3\nload_format: dummy\nmax_seq_len: 1024\nmax_concurrent_requests: 8\n"
        "node_groups:\n  - {node_names: [llm], ranks: [0]}\n  - {node_names: [vocoder], ranks: [1]}\n"
        "resources:\n  kv_cache: {max_num_pages: 512, page_size: 16}\n"
        f"model_kwargs:\n  dummy_scale: tiny\n  voices_dir: {voices}\n")
    with launch_server("cosyvoice3", work, ["--config", str(work / "cosyvoice3.yaml")]) as live:
        yield live


def test_openai_speech_returns_a_24khz_wav_and_streams_the_same(server) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    extra = {"seed": 5, "ref_audio": data_uri(clip_wav()), "ref_text": "A short clip.", "sentence_chunking": False}
    audio = client.audio.speech.create(model="cosyvoice3", voice="clone", input="Hi there.", response_format="wav",
                                       extra_body=extra)
    samples, rate = sf.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == 24000 and samples.ndim == 1 and samples.size > 0 and np.abs(samples).max() > 0

    whole = client.audio.speech.create(model="cosyvoice3", voice="clone", input="Hi there.", response_format="pcm",
                                       extra_body=extra).content
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice3", voice="clone", input="Hi there.", response_format="pcm",
            extra_body={**extra, "stream": True}) as response:
        chunks = list(response.iter_bytes())
    assert b"".join(chunks) == whole == samples.tobytes()  # seeded: the streamed chunks join to the whole


def test_a_preset_voice_speaks(server) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    pcm = client.audio.speech.create(model="cosyvoice3", voice="anna", input="Hi.", response_format="pcm",
                                     extra_body={"seed": 1}).content
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    styled = client.audio.speech.create(model="cosyvoice3", voice="anna", input="Hi.", response_format="pcm",
                                        instructions="Speak slowly.", extra_body={"seed": 1}).content
    assert styled != pcm  # the instruction is part of the LM's prompt
    voices = httpx.get(f"{server.url}/v1/audio/voices", params={"model": "cosyvoice3"}).json()
    assert "anna" in str(voices)


@pytest.mark.parametrize(("body", "field"), [
    ({"voice": "nobody"}, "voice"),
    ({"voice": "anna", "speed": 2.0}, "speed"),
    ({"voice": "anna", "input": ""}, "input"),
    ({"voice": "anna", "ref_audio": "not audio"}, "ref_audio"),
    ({"voice": "anna", "temperature": 0.5}, "model_kwargs"),  # RAS sampling has fixed settings
])
def test_bad_inputs_get_a_4xx_naming_the_field(server, body, field) -> None:
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "cosyvoice3", "input": "Hi.", **body},
                   timeout=REQUEST_TIMEOUT_S)
    assert 400 <= r.status_code < 500 and field in r.text, (r.status_code, r.text)
