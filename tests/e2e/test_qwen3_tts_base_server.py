"""Qwen3-TTS Base over HTTP: a real ``mstar serve qwen3_tts_base`` on a tiny dummy checkpoint,
cloning with the official ``openai`` client from a WAV data URI (``x_vector_only_mode``: the
clip's x-vector in the built-in speaker's place); a clip of other content speaks differently,
the same clip the same (its x-vector encoded once, /metrics); a preset of ``voices_dir`` is
listed by /v1/audio/voices and speaks as its clip uploaded; bad ``ref_audio`` and a missing
``ref_text`` get a 400 naming the field."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import soundfile as sf
from live_server import launch_server
from openai import OpenAI

from tests.support.qwen3_tts_dir import deployment_yaml, write_checkpoint

TIMEOUT_S = 120.0


def clip_uri(pitch: float, seconds: float = 1.0, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    sf.write(out, (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen3_tts_base")
    checkpoint = write_checkpoint(work / "ckpt", "base")
    voices = work / "voices"
    voices.mkdir()
    (voices / "deep.wav").write_bytes(base64.b64decode(clip_uri(150).partition(",")[2]))
    yaml = deployment_yaml("qwen3_tts_base", checkpoint)
    yaml = yaml.replace("model_kwargs: {", f"model_kwargs: {{voices_dir: {voices}, ")
    (work / "base.yaml").write_text(yaml)
    with launch_server("qwen3_tts_base", work, ["--config", str(work / "base.yaml")]) as live:
        yield live


def clone(server, ref_audio: str, **extra) -> bytes:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    body = {"seed": 4, "max_tokens": 6, "ref_audio": ref_audio, "x_vector_only_mode": True, **extra}
    return client.audio.speech.create(model="qwen3_tts_base", voice="clone", input="Hello there.",
                                      response_format="pcm", extra_body=body).content


def cache_gauges(server) -> dict[str, float]:
    lines = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
    return {line.split()[0].removeprefix("mstar_conditioning_cache_"): float(line.split()[1])
            for line in lines if line.startswith("mstar_conditioning_cache_")}


def test_clone_from_a_wav_data_uri(server) -> None:
    before = cache_gauges(server)
    low = clone(server, clip_uri(150))
    assert len(low) > 0 and len(low) % 2 == 0
    assert clone(server, clip_uri(150), ref_text="Its words: not part of an x-vector.") == low  # seeded
    assert clone(server, clip_uri(400)) != low  # another voice
    after = cache_gauges(server)  # 150 Hz encoded once (whatever its transcript), 400 Hz once
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (2, 1)
    assert after["entries"] == before["entries"] + 2 and after["bytes"] > before["bytes"]


def test_presets_are_listed_and_speak_as_their_clip(server) -> None:
    voices = httpx.get(f"{server.url}/v1/audio/voices", params={"model": "qwen3_tts_base"}, timeout=10).json()
    assert voices == {"voices": [{"voice_id": "deep", "name": "deep", "model": "qwen3_tts_base", "language": None,
                                  "source": "preset"}]}
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    preset = client.audio.speech.create(model="qwen3_tts_base", voice="deep", input="Hello there.",
                                        response_format="pcm", extra_body={"seed": 4, "max_tokens": 6}).content
    assert preset == clone(server, clip_uri(150))


@pytest.mark.parametrize(("body", "field"), [
    ({"ref_audio": "not audio", "x_vector_only_mode": True}, "ref_audio"),
    ({"ref_audio": "data:audio/wav;base64,UklGRg==", "x_vector_only_mode": True}, "ref_audio"),
    ({}, "ref_audio"),
    ({"ref_audio": clip_uri(200)}, "ref_text"),
    ({"ref_audio": clip_uri(200), "ref_text": "Hi."}, "x_vector_only_mode"),
])
def test_bad_clones_get_a_400_naming_the_field(server, body, field) -> None:
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "qwen3_tts_base", "input": "Hi.", **body},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400 and field in r.text, (r.status_code, r.text)
