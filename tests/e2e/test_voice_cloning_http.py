"""The shared voice-cloning surface over HTTP: ``toy_cloner`` (a test-only model that clones,
``tests/support/cloner.py``) in process under uvicorn, one server for the file, driven by the
official ``openai`` client, the SDK and plain HTTP.

It checks that a clip sent as ``ref_audio`` (data URI or bare base64, in ``extra_body``) is
what the audio is conditioned on; that a clip is encoded once per content, across requests
and across the sentence pieces of one request, and again for a new transcript; that streamed
pieces join to the whole; that /generate and the SDK's ``tts(reference_audio=...)`` clone the
same; that presets from ``voices_dir`` are listed and cloned; and that every bad clip or
field is a 400 naming ``ref_audio`` or ``ref_text``."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from inprocess import deployed
from live_server import Uvicorn

from mstar import MStarClient
from mstar.runtime.launch import Deployment
from mstar.server.app import create_app
from tests.support.cloner import PLAIN, expected_audio, timbre_of

MODEL = "toy_cloner"
PCM16_ATOL = 1.01 / 32767
SHORT = "Hello there."
LONG = "The first piece is short. Then come longer sentences, packed up to the limit. And one more at the end!"


def tone(seconds: float, rate: int, amplitude: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (amplitude * np.sin(2 * np.pi * 330 * t)).astype(np.float32)
    return mono if channels == 1 else np.repeat(mono[:, None], channels, axis=1)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


CLIP = tone(0.5, 22050, 0.4)
CLIP_WAV = wav_bytes(CLIP, 22050)


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("voices")
    (folder / "narrator.wav").write_bytes(wav_bytes(tone(0.3, 16000, 0.2), 16000))
    (folder / "narrator.txt").write_text("Once upon a time.\n")
    return folder


@pytest.fixture(scope="module")
def deployment(presets: Path) -> Iterator[Deployment]:
    with deployed({"model": MODEL, "device": "cpu", "max_concurrent_requests": 8,
                   "model_kwargs": {"voices_dir": str(presets)}}) as d:
        yield d


@pytest.fixture(scope="module")
def server(deployment: Deployment) -> Iterator[Uvicorn]:
    with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
        yield live


@pytest.fixture
def model(deployment: Deployment):
    spec = deployment.backend.spec
    spec.conditioned.clear()
    spec.clip_memo.clear()  # each test starts with nothing encoded
    return spec


def speak(oai: openai.OpenAI, text: str = SHORT, **extra) -> np.ndarray:
    audio = oai.audio.speech.create(model=MODEL, voice="plain", input=text, response_format="pcm", extra_body=extra)
    return np.frombuffer(audio.content, "<i2") / 32767.0


def close(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.abs(got - want).max() <= PCM16_ATOL


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["param"], error["message"]


# ------------------------------------------------------------------------ cloning


def test_the_clip_conditions_the_audio(oai, model):
    assert close(speak(oai), expected_audio(SHORT, PLAIN))  # no clip: the bundled voice
    got = speak(oai, ref_audio=data_uri(CLIP_WAV), ref_text="hi")
    assert close(got, expected_audio(SHORT, timbre_of(CLIP, 22050, "hi")))
    assert model.conditioned == [(CLIP.size, 22050, "hi")]


def test_a_clip_is_encoded_once_across_requests_and_pieces(oai, model):
    timbre = timbre_of(CLIP, 22050, None)
    assert close(speak(oai, LONG, ref_audio=data_uri(CLIP_WAV)), expected_audio(LONG, timbre))
    assert len(expected_audio(LONG, timbre)) > 0 and len(model.conditioned) == 1  # every piece after the first hit
    bare = base64.b64encode(CLIP_WAV).decode()
    assert close(speak(oai, ref_audio=bare), expected_audio(SHORT, timbre))  # bare base64: the same content
    stereo = wav_bytes(np.stack([CLIP, CLIP], axis=1), 22050)  # another file, the same samples once downmixed
    assert close(speak(oai, ref_audio=data_uri(stereo)), expected_audio(SHORT, timbre))
    assert len(model.conditioned) == 1 and model.clip_memo.hits >= 3
    speak(oai, ref_audio=bare, ref_text="a new transcript")
    assert model.conditioned[1:] == [(CLIP.size, 22050, "a new transcript")]


def test_the_memo_is_bounded(oai, model):
    for i in range(model.clip_memo_size + 1):
        speak(oai, ref_audio=data_uri(wav_bytes(tone(0.2, 16000, 0.1 + 0.05 * i), 16000)))
    assert len(model.clip_memo) == model.clip_memo_size
    speak(oai, ref_audio=data_uri(wav_bytes(tone(0.2, 16000, 0.1), 16000)))  # the oldest was evicted
    assert len(model.conditioned) == model.clip_memo_size + 2


def test_concurrent_requests_share_one_encoding_and_equal_their_solo_audio(oai, model):
    clips = [tone(0.3, 24000, 0.2), tone(0.3, 24000, 0.3)]
    uris = [data_uri(wav_bytes(c, 24000)) for c in clips]
    texts = [SHORT, LONG]
    jobs = [(texts[i % 2], i % 2) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: speak(oai, job[0], ref_audio=uris[job[1]]), jobs))
    for (text, which), audio in zip(jobs, got):
        assert close(audio, expected_audio(text, timbre_of(clips[which], 24000, None)))
    # two clips (of one length), each encoded once however the eight requests interleave
    assert model.conditioned == [(clips[0].size, 24000, None)] * 2


def test_streamed_pieces_join_to_the_whole(oai, model):
    whole = speak(oai, LONG, ref_audio=data_uri(CLIP_WAV))
    with oai.audio.speech.with_streaming_response.create(
            model=MODEL, voice="plain", input=LONG, response_format="pcm",
            extra_body={"ref_audio": data_uri(CLIP_WAV), "stream": True}) as response:
        pieces = [p for p in response.iter_bytes() if p]
    assert np.array_equal(np.frombuffer(b"".join(pieces), "<i2") / 32767.0, whole)
    assert len(model.conditioned) == 1


def test_sentence_chunking_off_speaks_one_piece(oai, model):
    timbre, text = timbre_of(CLIP, 22050, None), "One. Two. Three. Four. Five."  # two pieces when chunked
    whole = speak(oai, text, ref_audio=data_uri(CLIP_WAV), sentence_chunking=False)
    assert close(whole, expected_audio(text, timbre, sentence_chunking=False))
    assert not close(whole, expected_audio(text, timbre))  # a piece restarts the sine's phase


def test_generate_and_the_sdk_clone_the_same(server, model, tmp_path):
    want = expected_audio(SHORT, timbre_of(CLIP, 22050, "hi"))
    form = {"text": SHORT, "output_modalities": "audio",
            "model_kwargs": json.dumps({"ref_audio": data_uri(CLIP_WAV), "ref_text": "hi"})}
    body = httpx.post(f"{server.url}/generate", data=form, timeout=60).json()
    assert np.allclose(np.frombuffer(base64.b64decode(body["data"]["audio"]), "<f4"), want, atol=1e-6)
    path = tmp_path / "me.wav"
    path.write_bytes(CLIP_WAV)
    with MStarClient(server.url) as sdk:
        for reference in (path, str(path), CLIP_WAV):
            got = sdk.tts(SHORT, response_format="pcm", reference_audio=reference, ref_text="hi").audio
            assert close(np.frombuffer(got, "<i2") / 32767.0, want)
        samples = sdk.tts(SHORT, response_format="pcm", reference_audio=CLIP, reference_sample_rate=22050,
                          ref_text="hi").audio
        assert close(np.frombuffer(samples, "<i2") / 32767.0, want)
    assert len(model.conditioned) == 1  # five requests, one clip


def test_presets_are_listed_and_cloned(oai, server, model, presets):
    voices = httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]
    assert voices == [
        {"voice_id": "plain", "name": "plain", "model": MODEL, "language": "en", "source": "bundled"},
        {"voice_id": "narrator", "name": "narrator", "model": MODEL, "language": "en", "source": "preset"}]
    assert httpx.get(f"{server.url}/v1/audio/voices", params={"model": MODEL}).json()["voices"] == voices
    assert error_of(httpx.get(f"{server.url}/v1/audio/voices", params={"model": "nope"}))[:2] == (404, "model")
    audio = oai.audio.speech.create(model=MODEL, voice="narrator", input=SHORT, response_format="pcm")
    preset = sf.read(presets / "narrator.wav", dtype="float32")[0]
    want = expected_audio(SHORT, timbre_of(preset, 16000, "Once upon a time."))
    assert close(np.frombuffer(audio.content, "<i2") / 32767.0, want)
    assert model.conditioned == [(preset.size, 16000, "Once upon a time.")]


# ------------------------------------------------------------------------- refusals

BAD_CLIPS = [
    (data_uri(b""), "ref_audio", "no bytes"),
    ("", "ref_audio", "empty"),
    (data_uri(b"RIFF\x00\x00\x00\x00WAVEjunk"), "ref_audio", "could not decode"),
    (data_uri(b"\x89PNG\r\n\x1a\n" + bytes(32)), "ref_audio", "PNG image"),
    (data_uri(wav_bytes(np.zeros(61 * 8000, np.float32), 8000)), "ref_audio", "the limit is 60 s"),
    (data_uri(wav_bytes(tone(0.5, 4000, 0.3), 4000)), "ref_audio", "4000 Hz"),
    (data_uri(wav_bytes(tone(0.5, 16000, 0.3, channels=3), 16000)), "ref_audio", "3 channels"),
    (data_uri(wav_bytes(tone(0.05, 16000, 0.3), 16000)), "ref_audio", "shorter than 0.1 s"),  # the family's rule
    ("/etc/passwd", "ref_audio", "paths on the server are refused"),
    ("file:///etc/passwd", "ref_audio", "file:// URLs are refused"),
    ("http://example.com/me.wav", "ref_audio", "MSTAR_ALLOW_REMOTE=1"),
    ("not base64 !", "ref_audio", "neither a data URI"),
]


@pytest.mark.parametrize(("ref_audio", "param", "needle"), BAD_CLIPS)
def test_bad_clips_are_a_400_naming_ref_audio(server, ref_audio, param, needle):
    response = httpx.post(f"{server.url}/v1/audio/speech", json={"input": SHORT, "ref_audio": ref_audio}, timeout=60)
    status, got_param, message = error_of(response)
    assert (status, got_param) == (400, param) and needle in message, message


def test_a_remote_clip_needs_the_switch_and_a_public_host(server, monkeypatch):
    monkeypatch.setenv("MSTAR_ALLOW_REMOTE", "1")  # read per request: the fetch goes on to check the host
    response = httpx.post(f"{server.url}/v1/audio/speech", timeout=60,
                          json={"input": SHORT, "ref_audio": "http://127.0.0.1:9/me.wav"})
    status, param, message = error_of(response)
    assert (status, param) == (400, "ref_audio") and "loopback" in message, message


def test_ref_text_alone_and_bad_fields_name_themselves(server):
    cases = [({"ref_text": "hi"}, "ref_text"), ({"ref_audio": 5}, "ref_audio"),
             ({"ref_audio": data_uri(CLIP_WAV), "ref_text": "x" * 5000}, "ref_text"),
             ({"sentence_chunking": "sometimes"}, "sentence_chunking")]
    for extra, param in cases:
        response = httpx.post(f"{server.url}/v1/audio/speech", json={"input": SHORT, **extra}, timeout=60)
        assert error_of(response)[:2] == (400, param), response.text
    form = {"text": SHORT, "output_modalities": "audio", "model_kwargs": json.dumps({"ref_audio": "/etc/passwd"})}
    response = httpx.post(f"{server.url}/generate", data=form, timeout=60)
    assert error_of(response)[:2] == (400, "ref_audio")

