"""Qwen3-TTS with the 12 Hz codec on a second worker (``configs/qwen3_tts_1p7b_split.yaml``'s
layout, here two CPU ranks): the talker's frames cross to the codec's process as a stream and
the served audio is the same as with both nodes on one worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from live_server import launch_server
from openai import OpenAI

from mstar.config import load_config
from tests.support.qwen3_tts_dir import deployment_yaml, eager_pcm, write_checkpoint

FRAMES = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_tts_split_ckpt"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    work = tmp_path_factory.mktemp("qwen3_tts_split")
    (work / "split.yaml").write_text(deployment_yaml("qwen3_tts", checkpoint, split=True))
    with launch_server("qwen3_tts", work, ["--config", str(work / "split.yaml")]) as live:
        yield live


def test_split_workers_serve_the_eager_audio(server, checkpoint) -> None:
    oai = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120.0)
    pcm = oai.audio.speech.create(model="qwen3_tts", voice="vivian", input="Hello there.", response_format="pcm",
                                  extra_body={"seed": 0, "max_tokens": FRAMES, "temperature": 0.0}).content
    served = np.frombuffer(pcm, "<i2").astype(int)
    expected = eager_pcm(checkpoint, "Hello there.", FRAMES)
    assert served.shape == expected.shape and np.abs(served - expected).max() <= 2
    assert np.abs(served).max() > 100


def test_the_shipped_split_config_puts_both_ranks_on_gpu_0() -> None:
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "qwen3_tts_1p7b_split.yaml")
    assert [g.node_names for g in config.node_groups] == [["talker"], ["codec"]]
    assert str(config.device_of(0)) == str(config.device_of(1)) == "cuda:0"
