"""Qwen3-TTS served with the talker's overlap scheduling (``model_kwargs.overlap_scheduling``;
the CUDA graph knobs need a GPU): greedy audio equals the eager loop's, 4 concurrent seeded
requests equal their solo audio, and streamed equals plain, as without the knob."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from live_server import launch_server
from openai import OpenAI

from tests.support.qwen3_tts_dir import deployment_yaml, eager_pcm, write_checkpoint

TIMEOUT_S = 120.0
FRAMES = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_tts_overlap_ckpt"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    work = tmp_path_factory.mktemp("qwen3_tts_overlap")
    yaml = deployment_yaml("qwen3_tts", checkpoint)
    yaml = yaml.replace("model_kwargs: {", "model_kwargs: {overlap_scheduling: true, ")
    assert "overlap_scheduling: true" in yaml
    (work / "qwen3_tts.yaml").write_text(yaml)
    with launch_server("qwen3_tts", work, ["--config", str(work / "qwen3_tts.yaml")]) as live:
        yield live


def speak(server, text: str, seed: int, **extra) -> bytes:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    return client.audio.speech.create(model="qwen3_tts", voice="vivian", input=text, response_format="pcm",
                                      extra_body={"seed": seed, "max_tokens": FRAMES, **extra}).content


def test_greedy_audio_equals_the_eager_loop(server, checkpoint) -> None:
    expected = eager_pcm(checkpoint, "Hello there.", FRAMES)
    served = np.frombuffer(speak(server, "Hello there.", 0, temperature=0.0), "<i2").astype(int)
    assert served.shape == expected.shape and np.abs(served - expected).max() <= 2


def test_concurrent_requests_equal_their_solo_audio_and_stream(server) -> None:
    texts = [f"Sentence number {i}." for i in range(4)]
    solo = [speak(server, t, 10 + i) for i, t in enumerate(texts)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda i: speak(server, texts[i], 10 + i), range(4)))
    for a, b in zip(together, solo):
        x, y = np.frombuffer(a, "<i2").astype(int), np.frombuffer(b, "<i2").astype(int)
        assert x.shape == y.shape and np.abs(x - y).max() <= 2, np.abs(x - y).max()
    assert len(set(solo)) > 1
    streamed = speak(server, texts[0], 10, stream=True)
    assert streamed == solo[0]
