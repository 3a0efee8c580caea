"""Qwen3-TTS Base over HTTP: a real ``mstar serve qwen3_tts_base`` on a tiny dummy checkpoint,
cloning with the official ``openai`` client from a WAV data URI: ``x_vector_only_mode`` (the
clip's x-vector in the built-in speaker's place) and in context (``ref_text``: the clip's codes
and transcript in the prompt; greedy, the served audio is the eager loop's, plain and streamed);
a clip of other content speaks differently, the same clip the same (encoded once, /metrics,
whatever its transcript or mode); a preset of ``voices_dir`` is listed by /v1/audio/voices and
speaks as its clip uploaded; bad ``ref_audio`` and a missing ``ref_text`` get a 400 naming the
field."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from live_server import launch_server
from openai import OpenAI

from mstar.audio.io import resample
from mstar.audio.reference import decode_reference
from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
from mstar.model.qwen3_tts.prompt import assistant_text, talker_prompt, transcript_ids
from mstar.model.qwen3_tts.speech import run_talker
from tests.support.qwen3_tts_dir import deployment_yaml, write_checkpoint

TIMEOUT_S = 120.0


def clip_uri(pitch: float, seconds: float = 1.0, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    sf.write(out, (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_tts_base_ckpt"), "base")


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    work = tmp_path_factory.mktemp("qwen3_tts_base")
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
    # Another voice: its own memo entry. Its audio is not compared: the tiny random speaker
    # encoder's x-vectors barely move the talker's logits (even greedy frames come out equal),
    # and one seed's draws share their noise. The x-vector's path into the talker is checked
    # frame for frame against the reference in test_qwen3_tts_generate.
    assert len(clone(server, clip_uri(400))) > 0
    after = cache_gauges(server)  # 150 Hz encoded once (whatever its transcript), 400 Hz once
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (2, 1)
    assert after["entries"] == before["entries"] + 2 and after["bytes"] > before["bytes"]


ICL_CLIP = clip_uri(180, seconds=0.15)  # 75 codec frames at 24 kHz: the prompt fits max_seq_len 256
ICL_TEXT = "Short words."


@torch.no_grad()
def test_in_context_clone_equals_the_eager_loop(server, checkpoint) -> None:
    """Greedy in-context cloning: the served audio is ``run_talker``'s frames (the ICL prompt
    checked against the reference) from the clip's x-vector, codes and transcript, decoded over
    the deployment's ramp; streamed, the chunks join to it."""
    body = {"seed": 4, "max_tokens": 6, "ref_audio": ICL_CLIP, "ref_text": ICL_TEXT, "temperature": 0.0}
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    pcm = client.audio.speech.create(model="qwen3_tts_base", voice="clone", input="Hello there.",
                                     response_format="pcm", extra_body=body).content
    with client.audio.speech.with_streaming_response.create(
            model="qwen3_tts_base", voice="clone", input="Hello there.", response_format="pcm",
            extra_body={**body, "stream": True}) as response:
        assert b"".join(response.iter_bytes()) == pcm
    ckpt = Qwen3TTSCheckpoint.locate(str(checkpoint), dummy=True)
    config, tokenizer = ckpt.config(), ckpt.tokenizer()
    talker = ckpt.talker("cpu", torch.float32, dummy=True, seed=0)
    codec = ckpt.codec("cpu", torch.float32, dummy=True, seed=1)
    clip = decode_reference(base64.b64decode(ICL_CLIP.partition(",")[2]), text=ICL_TEXT, field="ref_audio")
    samples = resample(np.frombuffer(clip.pcm, "<f4"), clip.sample_rate, 24000)
    x_vector = ckpt.speaker_encoder("cpu", torch.float32, dummy=True, seed=2).embed_clip(samples)
    codes = ckpt.codec_encoder("cpu", torch.float32, dummy=True, seed=3).encode(torch.as_tensor(samples).float())
    assert codes.shape == (75, 4)
    ids = tokenizer(assistant_text("Hello there."), add_special_tokens=False)["input_ids"]
    prompt = talker_prompt(talker, config, ids, speaker_embed=x_vector,
                           reference=(transcript_ids(tokenizer, ICL_TEXT), codes))
    frames = run_talker(talker, prompt, max_frames=6)
    # the clip's frames top up the first windows' context, as the reference decodes [clip, new]
    wave = torch.cat(list(codec.decode_stream(frames[None], ramp=(1, 3, 8, 6), left_context=12,
                                              prefix=codes.T[None])), dim=-1)[0]
    expected = np.rint(np.clip(wave.numpy(), -1, 1) * 32767).astype(int)
    served = np.frombuffer(pcm, "<i2").astype(int)
    assert served.shape == expected.shape and np.abs(served - expected).max() <= 2
    assert np.abs(served).max() > 100
    alone = torch.cat(list(codec.decode_stream(frames[None], ramp=(1, 3, 8, 6), left_context=12)), dim=-1)[0]
    assert np.abs(np.rint(np.clip(alone.numpy(), -1, 1) * 32767) - expected).max() > 100  # the context counts
    x_only = clone(server, ICL_CLIP)  # the x-vector alone speaks otherwise
    assert x_only != pcm


def test_concurrent_clones_equal_their_solo_audio(server) -> None:
    """In-context clones of two clips and x-vector clones, sampled (seeded), all at once: each
    equals its solo audio (batched codec windows with and without the clip's context)."""
    other = clip_uri(260, seconds=0.12)
    bodies = [{"ref_audio": ICL_CLIP, "ref_text": ICL_TEXT}, {"ref_audio": other, "ref_text": "Other words here."},
              {"ref_audio": ICL_CLIP, "x_vector_only_mode": True}, {"ref_audio": other, "x_vector_only_mode": True}]

    def speak(i: int) -> bytes:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
        return client.audio.speech.create(model="qwen3_tts_base", voice="clone", input=f"Sentence {i}.",
                                          response_format="pcm",
                                          extra_body={"seed": 20 + i, "max_tokens": 6, **bodies[i % 4]}).content

    solo = [speak(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(speak, range(8)))
    for a, b in zip(together, solo):  # batched float maths may move a sample by a step of int16
        x, y = np.frombuffer(a, "<i2").astype(int), np.frombuffer(b, "<i2").astype(int)
        assert x.shape == y.shape and np.abs(x - y).max() <= 2, np.abs(x - y).max()
    assert len(set(solo)) == 8


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
    ({"ref_audio": clip_uri(200), "ref_text": "   "}, "ref_text"),
    ({"ref_audio": clip_uri(200), "ref_text": "Hi."}, "ref_audio"),  # 500 frames: past max_seq_len
])
def test_bad_clones_get_a_400_naming_the_field(server, body, field) -> None:
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "qwen3_tts_base", "input": "Hi.", **body},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400 and field in r.text, (r.status_code, r.text)
