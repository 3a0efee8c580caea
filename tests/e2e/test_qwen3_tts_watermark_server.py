"""Qwen3-TTS over HTTP with the AudioSeal watermark on (a tiny seeded generator file): the
greedy audio is the eager loop's frames decoded over the ramp and then marked as one whole
utterance, and a streamed response is byte for byte the plain one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from live_server import launch_server
from openai import OpenAI

from mstar.model import audio_watermark as aw
from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
from mstar.model.qwen3_tts.prompt import assistant_text, talker_prompt
from mstar.model.qwen3_tts.speech import run_talker
from tests.support.qwen3_tts_dir import deployment_yaml, write_checkpoint

TIMEOUT_S = 120.0
FRAMES = 6
TINY = {"nbits": 16, "seanet": {"causal": True, "dimension": 8, "n_filters": 4, "ratios": [4, 2], "lstm": 1}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen3_tts_wm")
    checkpoint = write_checkpoint(work / "ckpt")
    torch.manual_seed(0)
    generator = aw.AudioSealGenerator(aw.SEANetConfig.from_dict(TINY)).eval()
    with torch.no_grad():
        for p in generator.parameters():
            p.normal_(0, 0.2)
    torch.save({"xp.cfg": TINY, "model": generator.state_dict()}, work / "generator.pth")
    yaml = deployment_yaml("qwen3_tts", checkpoint)
    marks = f"audio_watermark: {{enabled: true, message: 48879, alpha: 0.5, generator: {work / 'generator.pth'}}}"
    yaml = yaml.replace("codec_left_context: 12}", f"codec_left_context: 12, {marks}}}")
    (work / "qwen3_tts.yaml").write_text(yaml)
    with launch_server("qwen3_tts", work, ["--config", str(work / "qwen3_tts.yaml")]) as live:
        yield live, checkpoint, generator


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


@torch.no_grad()
def test_marked_audio_plain_and_streamed(setup) -> None:
    server, checkpoint, generator = setup
    body = {"seed": 0, "max_tokens": FRAMES, "temperature": 0.0}
    whole = client(server).audio.speech.create(model="qwen3_tts", voice="vivian", input="Hello there.",
                                               response_format="pcm", extra_body=body).content
    with client(server).audio.speech.with_streaming_response.create(
            model="qwen3_tts", voice="vivian", input="Hello there.", response_format="pcm",
            extra_body={**body, "stream": True}) as response:
        streamed = b"".join(response.iter_bytes())
    assert streamed == whole
    ckpt = Qwen3TTSCheckpoint.locate(str(checkpoint), dummy=True)
    talker = ckpt.talker("cpu", torch.float32, dummy=True, seed=0)
    codec = ckpt.codec("cpu", torch.float32, dummy=True, seed=1)
    ids = ckpt.tokenizer()(assistant_text("Hello there."), add_special_tokens=False)["input_ids"]
    codes = run_talker(talker, talker_prompt(talker, ckpt.config(), ids, speaker="vivian", non_streaming=True),
                       max_frames=FRAMES)
    plain = torch.cat(list(codec.decode_stream(codes[None], ramp=(1, 3, 8, 6), left_context=12)), dim=-1)
    marked = generator(plain[:, None], message=0xBEEF, alpha=0.5)[0, 0]
    expected = np.rint(np.clip(marked.numpy(), -1, 1) * 32767).astype(int)
    unmarked = np.rint(np.clip(plain[0].numpy(), -1, 1) * 32767).astype(int)
    served = np.frombuffer(whole, "<i2").astype(int)
    assert served.shape == expected.shape and np.abs(served - expected).max() <= 2
    assert np.abs(served - unmarked).max() > 100  # the mark is there
