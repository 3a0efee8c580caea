"""Qwen3-TTS Base over HTTP: a real ``mstar serve qwen3_tts_base`` on a tiny dummy checkpoint,
cloning with the official ``openai`` client from a WAV data URI (``x_vector_only_mode``: the
clip's x-vector in the built-in speaker's place); a clip of other content speaks differently,
the same clip the same; bad ``ref_audio`` and a missing ``ref_text`` get a 400 naming the field."""

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
    (work / "base.yaml").write_text(deployment_yaml("qwen3_tts_base", checkpoint))
    with launch_server("qwen3_tts_base", work, ["--config", str(work / "base.yaml")]) as live:
        yield live


def clone(server, ref_audio: str, **extra) -> bytes:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    body = {"seed": 4, "max_tokens": 6, "ref_audio": ref_audio, "x_vector_only_mode": True, **extra}
    return client.audio.speech.create(model="qwen3_tts_base", voice="clone", input="Hello there.",
                                      response_format="pcm", extra_body=body).content


def test_clone_from_a_wav_data_uri(server) -> None:
    low = clone(server, clip_uri(150))
    assert len(low) > 0 and len(low) % 2 == 0
    assert clone(server, clip_uri(150)) == low  # seeded, and the clip's x-vector memoised
    assert clone(server, clip_uri(400)) != low  # another voice


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
