"""Qwen3-TTS served with the rate-aware codec ramp (``model_kwargs.codec_ramp: adaptive``, a
wide margin so that the windows depart from the fixed ramp): the windows then depend on the
step times, yet with a left context covering the utterance every window is exact, so the
audio, plain or streamed, equals the whole decode of the eager loop's frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from live_server import launch_server
from openai import OpenAI

from tests.support.qwen3_tts_dir import deployment_yaml, write_checkpoint

TIMEOUT_S = 120.0
FRAMES = 14


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_tts_ramp_ckpt"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    work = tmp_path_factory.mktemp("qwen3_tts_ramp")
    yaml = deployment_yaml("qwen3_tts", checkpoint)
    knobs = "codec_left_context: 72, codec_ramp: adaptive, codec_ramp_margin: 4.0"
    yaml = yaml.replace("codec_left_context: 12", knobs)
    assert "codec_ramp: adaptive" in yaml
    (work / "qwen3_tts.yaml").write_text(yaml)
    with launch_server("qwen3_tts", work, ["--config", str(work / "qwen3_tts.yaml")]) as live:
        yield live


@torch.no_grad()
def whole_decode_pcm(checkpoint, text: str) -> np.ndarray:
    """The eager loop's greedy frames decoded whole (no windows), as int16."""
    from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
    from mstar.model.qwen3_tts.prompt import assistant_text, talker_prompt
    from mstar.model.qwen3_tts.speech import run_talker

    ckpt = Qwen3TTSCheckpoint.locate(str(checkpoint), dummy=True)
    talker = ckpt.talker("cpu", torch.float32, dummy=True, seed=0)
    codec = ckpt.codec("cpu", torch.float32, dummy=True, seed=1)
    ids = ckpt.tokenizer()(assistant_text(text), add_special_tokens=False)["input_ids"]
    codes = run_talker(talker, talker_prompt(talker, ckpt.config(), ids, speaker="vivian", non_streaming=True),
                       max_frames=FRAMES)
    wave = codec(codes[None])[0]
    return np.rint(np.clip(wave.numpy(), -1, 1) * 32767).astype(int)


def speak(server, text: str, **extra) -> np.ndarray:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    pcm = client.audio.speech.create(model="qwen3_tts", voice="vivian", input=text, response_format="pcm",
                                     extra_body={"max_tokens": FRAMES, "temperature": 0.0, **extra}).content
    return np.frombuffer(pcm, "<i2").astype(int)


def test_adaptive_windows_plain_and_streamed_equal_the_whole_decode(server, checkpoint) -> None:
    expected = whole_decode_pcm(checkpoint, "Hello there.")
    for stream in (False, True):
        served = speak(server, "Hello there.", stream=stream)
        assert served.shape == expected.shape and np.abs(served - expected).max() <= 2, stream
