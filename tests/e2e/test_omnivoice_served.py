"""OmniVoice served in process (CPU, fp32, a tiny release's configs and tokenizer with
``load_format: dummy`` weights) through the official ``openai`` client: cloning from a WAV data
URI with its ``ref_text``, ``language`` by name or id, concurrent requests equal to their solo
audio (seeded; they share canvas forwards), 400s naming ``ref_text``, ``ref_audio``,
``voice`` and ``input``, a clip sent again not encoded again (/metrics), and the presets of
``voices_dir`` listed by /v1/audio/voices and spoken as their clips are."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import soundfile as sf
from live_server import Uvicorn

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support.omnivoice import write_tiny_release

MODEL = "omnivoice"
RATE = 2400  # the tiny codec's
HOP = 96
EDGE = int(0.1 * RATE)


def clip_wav(seconds: float = 1.0, rate: int = 16000, pitch: float = 150.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.05 * np.sin(2 * np.pi * pitch * t) + 0.01 * np.random.default_rng(int(pitch)).standard_normal(t.size)
    out = io.BytesIO()
    sf.write(out, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


PRESET_WAV = clip_wav(pitch=260.0)
PRESET_TEXT = "Anna's own words"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    release = write_tiny_release(tmp_path_factory.mktemp("omnivoice"))
    voices = tmp_path_factory.mktemp("voices")
    (voices / "anna.wav").write_bytes(PRESET_WAV)
    (voices / "anna.txt").write_text(PRESET_TEXT + "\n")
    (voices / "mute.wav").write_bytes(clip_wav(pitch=90.0))  # no transcript
    deployment = start(parse_config({
        "model": MODEL, "model_path": str(release), "device": "cpu", "dtype": "float32", "load_format": "dummy",
        "max_concurrent_requests": 8, "node_groups": [{"node_names": ["canvas", "codec"], "ranks": [0]}],
        "model_kwargs": {"seed": 3, "num_step": 4, "voices_dir": str(voices)}}), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


def speak(oai: openai.OpenAI, text: str, fmt: str = "pcm", **extra) -> bytes:
    voice = extra.pop("voice", "clone" if "ref_audio" in extra else "auto")
    return oai.audio.speech.create(model=MODEL, voice=voice, input=text, response_format=fmt,
                                   extra_body=extra).content


def test_clones_from_a_wav_data_uri(oai: openai.OpenAI) -> None:
    clip = {"ref_audio": data_uri(clip_wav()), "ref_text": "A short clip", "seed": 7}
    audio = speak(oai, "Hello there.", fmt="wav", language="English", **clip)
    samples, rate = sf.read(io.BytesIO(audio), dtype="float32")
    assert rate == RATE and samples.ndim == 1
    assert (samples.size - 2 * EDGE) % HOP == 0 and samples.size > 2 * EDGE
    assert np.abs(samples[EDGE:-EDGE]).max() > 0 and not np.abs(samples[:EDGE]).any()
    again = speak(oai, "Hello there.", fmt="wav", language="English", **clip)
    assert again == audio  # seeded
    other = speak(oai, "Hello there.", fmt="wav", language="English", **{**clip, "seed": 8})
    assert other != audio


def test_language_by_name_or_id(oai: openai.OpenAI) -> None:
    clip = {"ref_audio": data_uri(clip_wav(pitch=220.0)), "ref_text": "Xin chào", "seed": 1}
    by_name = speak(oai, "Chào thế giới", language="Vietnamese", **clip)
    assert speak(oai, "Chào thế giới", language="vi", **clip) == by_name
    unknown = speak(oai, "Chào thế giới", language="Klingon", **clip)  # warns, speaks without a language
    assert unknown == speak(oai, "Chào thế giới", **clip)
    assert unknown != by_name


def test_auto_voice_needs_no_clip(oai: openai.OpenAI) -> None:
    pcm = np.frombuffer(speak(oai, "No reference here.", seed=2), "<i2")
    assert pcm.size > 2 * EDGE and np.abs(pcm).max() > 0


def test_concurrent_requests_equal_their_solo_audio(oai: openai.OpenAI) -> None:
    clip = data_uri(clip_wav(pitch=180.0))
    jobs = [dict(text=f"Sentence number {i}" + " and more" * (i % 3), seed=10 + i,
                 **({"ref_audio": clip, "ref_text": "A clip"} if i % 2 else {})) for i in range(8)]

    def run(job: dict) -> bytes:
        job = dict(job)
        return speak(oai, job.pop("text"), **job)

    alone = [run(job) for job in jobs]
    assert len(set(alone)) == 8
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, jobs))
    assert together == alone


@pytest.mark.parametrize(("extra", "field"), [
    ({"ref_audio": "CLIP"}, "ref_text"),
    ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(b"not audio at all").decode(),
      "ref_text": "words"}, "ref_audio"),
    ({"voice": "nobody"}, "voice"),
    ({"text": "x " * 2000}, "input"),
    ({"language": 5}, "language"),
])
def test_bad_requests_name_their_field(oai: openai.OpenAI, extra: dict, field: str) -> None:
    extra = dict(extra)
    if extra.get("ref_audio") == "CLIP":
        extra["ref_audio"] = data_uri(clip_wav())
    text = extra.pop("text", "Hello.")
    with pytest.raises(openai.BadRequestError) as err:
        speak(oai, text, **extra)
    assert field in str(err.value)


def test_generate_takes_the_same_options(oai: openai.OpenAI, http) -> None:
    import json

    options = {"seed": 4, "ref_audio": data_uri(clip_wav()), "ref_text": "A short clip", "language": "en"}
    form = {"text": "Hello again.", "output_modalities": "audio", "model_kwargs": json.dumps(options)}
    response = http.post("/generate", data=form)
    assert response.status_code == 200, response.text
    audio = np.frombuffer(base64.b64decode(response.json()["data"]["audio"]), "<f4")
    spoken = np.frombuffer(speak(oai, "Hello again.", **options), "<i2")
    assert audio.size == spoken.size > 0
    # the same audio, as float32 and as int16 (dummy weights are loud: int16 clips at full scale)
    assert np.abs(np.clip(audio, -1, 1) * 32767 - spoken).max() <= 1.0
    fewer = {**options, "num_step": 2}
    form["model_kwargs"] = json.dumps(fewer)
    assert http.post("/generate", data=form).json()["data"]["audio"] != response.json()["data"]["audio"]


def cache_gauges(http) -> dict[str, float]:
    lines = http.get("/metrics").text.splitlines()
    return {line.split()[0].removeprefix("mstar_conditioning_cache_"): float(line.split()[1])
            for line in lines if line.startswith("mstar_conditioning_cache_")}


def test_a_clip_sent_again_is_encoded_once(oai: openai.OpenAI, http) -> None:
    """The conditioning cache (/metrics' ``mstar_conditioning_cache_*``): the first request
    encodes the clip, the second (another transcript: the codes are the audio's) reuses it, and
    the first's audio is what a warm request speaks with the same transcript."""
    clip = {"ref_audio": data_uri(clip_wav(pitch=333.0)), "ref_text": "A clip", "seed": 5}
    before = cache_gauges(http)
    cold = speak(oai, "Once more.", **clip)
    after_cold = cache_gauges(http)
    assert after_cold["misses"] == before["misses"] + 1 and after_cold["hits"] == before["hits"]
    assert after_cold["entries"] == before["entries"] + 1 and after_cold["bytes"] > before["bytes"]
    retold = speak(oai, "Once more.", **{**clip, "ref_text": "Another transcript"})
    assert speak(oai, "Once more.", **clip) == cold and retold != cold
    after = cache_gauges(http)
    assert after["hits"] == after_cold["hits"] + 2 and after["misses"] == after_cold["misses"]


def test_presets_are_listed_and_cloned_as_their_clips(oai: openai.OpenAI, http) -> None:
    voices = http.get("/v1/audio/voices", params={"model": MODEL}).json()["voices"]
    assert [(v["voice_id"], v["source"], v["model"]) for v in voices] == [
        ("auto", "bundled", MODEL), ("anna", "preset", MODEL), ("mute", "preset", MODEL)]
    before = cache_gauges(http)
    preset = speak(oai, "A preset speaks.", voice="anna", seed=6)
    uploaded = speak(oai, "A preset speaks.", ref_audio=data_uri(PRESET_WAV), ref_text=PRESET_TEXT, seed=6)
    assert preset == uploaded and preset != speak(oai, "A preset speaks.", seed=6)
    after = cache_gauges(http)  # the preset's file and its upload are one clip: encoded once
    assert after["misses"] == before["misses"] + 1 and after["hits"] == before["hits"] + 1
    with pytest.raises(openai.BadRequestError, match="transcript") as err:
        speak(oai, "Hello.", voice="mute")
    assert "voice" in str(err.value)
    missing = http.get("/v1/audio/voices", params={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
