"""Chatterbox over HTTP: a real ``mstar serve`` of each key (tiny dummy weights, CPU) driven
by the official ``openai`` client: valid 24 kHz WAV, plain (the whole utterance) and streamed
(chunks of 8 tokens joined: the same length, repeatable when seeded; their closeness to the
whole decode is pinned in tests/chatterbox/test_chatterbox_streaming.py); a clone from a
``ref_audio`` data URI; eight concurrent seeded requests equal to their solo audio, plain and
streamed; Chatterbox's options on /generate; 4xx naming the field."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import soundfile as sf
from live_server import launch_server

KEYS = ("chatterbox", "chatterbox_multilingual", "chatterbox_turbo")
ROOT = Path(__file__).resolve().parents[2]
TEXT = "Hello there, how are you?"


@pytest.fixture(scope="module", params=KEYS)
def server(request, tmp_path_factory):
    key = request.param
    work = tmp_path_factory.mktemp(key)
    config = {"model": key, "load_format": "dummy", "device": "cpu", "max_concurrent_requests": 8,
              "node_groups": [{"node_names": ["t3", "s3gen"], "ranks": [0]}],
              "model_kwargs": {"dummy_scale": "tiny", "max_new_tokens_limit": 40,
                               "stream_first_chunk_tokens": 8, "stream_chunk_tokens": 8}}
    (work / "chatterbox.yaml").write_text(json.dumps(config))  # JSON is YAML
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(ROOT))  # the server runs this tree's mstar
        mp.setenv("MSTAR_WORKER_THREADS", "1")  # tiny models: a second BLAS thread only thrashes a busy box
        with launch_server(key, work, ["--config", str(work / "chatterbox.yaml")]) as live:
            live.key = key
            yield live


def pcm(oai, server, text: str = TEXT, **extra) -> np.ndarray:
    audio = oai.audio.speech.create(model=server.key, voice="default", input=text, response_format="pcm",
                                    extra_body=extra)
    return np.frombuffer(audio.content, "<i2")


def streamed_pcm(oai, server, text: str = TEXT, **extra) -> np.ndarray:
    with oai.audio.speech.with_streaming_response.create(
            model=server.key, voice="default", input=text, response_format="pcm",
            extra_body={**extra, "stream": True}) as response:
        return np.frombuffer(b"".join(response.iter_bytes()), "<i2")


def clip_uri(seconds: float = 6.0, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (150 + 30 * np.sin(2 * np.pi * 3 * t)) * t)
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def test_wav_at_24khz_plain_and_streamed(oai, server):
    audio = oai.audio.speech.create(model=server.key, voice="default", input=TEXT, response_format="wav",
                                    extra_body={"seed": 1})
    samples, rate = sf.read(io.BytesIO(audio.content))
    assert rate == 24000 and samples.ndim == 1 and len(samples) > 0
    assert np.abs(samples).max() > 0.003  # audible at 16 bits: the comparisons below mean something
    streamed = streamed_pcm(oai, server, seed=1)
    plain = pcm(oai, server, seed=1)
    assert len(streamed) == len(plain) == len(samples)  # the chunks tile the utterance
    assert np.abs(streamed).max() > 100 and not np.array_equal(streamed, plain)  # chunked: not the whole decode
    assert np.array_equal(streamed_pcm(oai, server, seed=1), streamed)


def test_clone_from_a_data_uri(oai, server):
    cloned = pcm(oai, server, seed=2, ref_audio=clip_uri())
    assert len(cloned) > 0
    assert np.array_equal(pcm(oai, server, seed=2, ref_audio=clip_uri()), cloned)
    assert not np.array_equal(pcm(oai, server, seed=2), cloned)


def test_eight_concurrent_requests_equal_their_solo_audio(oai, server):
    jobs = [(f"{TEXT} Number {i}.", 100 + i) for i in range(8)]
    solo = [pcm(oai, server, text, seed=seed) for text, seed in jobs]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda job: pcm(oai, server, job[0], seed=job[1]), jobs))
    for a, b in zip(solo, together, strict=True):
        assert np.abs(a).max() > 100 and np.array_equal(a, b)
    assert len({a.tobytes() for a in solo}) == len(solo)


def test_eight_concurrent_streams_equal_their_solo_streams(oai, server):
    """Streamed chunks that are ready together share one padded flow solve; a row equals its
    solo solve to float32 rounding (1e-5 of peak), so at 16 bits at most one step apart."""
    jobs = [(f"{TEXT} Number {i}.", 200 + i) for i in range(8)]
    solo = [streamed_pcm(oai, server, text, seed=seed) for text, seed in jobs]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda job: streamed_pcm(oai, server, job[0], seed=job[1]), jobs))
    for a, b in zip(solo, together, strict=True):
        assert np.abs(a).max() > 100 and len(a) == len(b)
        assert np.abs(a.astype(np.int32) - b).max() <= 1


def test_options_change_the_audio_and_generate_takes_them(oai, server, http):
    base = pcm(oai, server, seed=3)
    options = {"exaggeration": 1.0, "cfg_weight": 0.3, "temperature": 0.6, "top_p": 0.9, "min_p": 0.1,
               "repetition_penalty": 1.4, "max_new_tokens": 20, "watermark": False}
    if server.key == "chatterbox_multilingual":
        options["language_id"] = "de"
    assert not np.array_equal(pcm(oai, server, seed=3, **options), base)
    form = {"text": TEXT, "output_modalities": "audio",
            "model_kwargs": json.dumps({"seed": 3, "ref_audio": clip_uri(), **options})}
    response = http.post("/generate", data=form)
    assert response.status_code == 200, response.text
    audio = np.frombuffer(base64.b64decode(response.json()["data"]["audio"]), "<f4")
    cloned = pcm(oai, server, seed=3, ref_audio=clip_uri(), **options)
    assert len(audio) == len(cloned) > 0
    assert np.abs(audio * 32767 - cloned).max() <= 1.0  # the same audio, as float32 and as int16


@pytest.mark.parametrize(("extra", "field"), [
    ({"exaggeration": 5}, "exaggeration"),
    ({"cfg_weight": 2}, "cfg_weight"),
    ({"min_p": -1}, "min_p"),
    ({"max_new_tokens": 41}, "max_new_tokens"),
    ({"language_id": "xx"}, "language_id"),
    ({"watermark": "off"}, "watermark"),
    ({"ref_audio": "data:audio/wav;base64,UklGRg=="}, "ref_audio"),
])
def test_bad_inputs_get_a_4xx_naming_the_field(oai, server, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        pcm(oai, server, **extra)
    assert err.value.body["param"] == field, err.value.body
