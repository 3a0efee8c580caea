"""Omnilingual ASR CTC served in process (CPU, fp32, a tiny transformers-layout checkpoint
with ``load_format: dummy`` weights): the official ``openai`` client transcribes; 8 concurrent
requests give exactly what each gives alone (they share forwards); long uploads are cut by the
reference's window policy, one segment per window; language, prompt and temperature are
taken and ignored; limits and bad options are 400s naming them."""

from __future__ import annotations

import io
import json
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

MODEL = "omnilingual_asr_ctc_300m"
REQUEST_TIMEOUT_S = 60.0
VOCAB = 40


def noise_clip(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def wav(samples: np.ndarray, rate: int = 16000, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def write_checkpoint(directory) -> None:
    """transformers' layout, config and tokenizer only (the weights are dummy)."""
    from tokenizers import Tokenizer, models

    audio = dict(hidden_size=32, conv_dim=[16] * 4, conv_kernel=[10, 3, 3, 2], conv_stride=[5, 2, 2, 2],
                 num_attention_heads=4, num_hidden_layers=2, num_conv_pos_embeddings=16,
                 num_conv_pos_embedding_groups=4, intermediate_size=64)
    (directory / "config.json").write_text(json.dumps({"model_type": "omniasr_ctc", "vocab_size": VOCAB,
                                                       "audio_config": audio}))
    pieces = ["<s>", "<pad>", "</s>", "<unk>"] + [f"\u2581w{i}" for i in range(4, VOCAB)]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.add_special_tokens(["<s>", "<pad>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    checkpoint = tmp_path_factory.mktemp("omniasr")
    write_checkpoint(checkpoint)
    deployment = start(parse_config({
        "model": MODEL, "device": "cpu", "dtype": "float32", "load_format": "dummy", "max_concurrent_requests": 8,
        "node_groups": [{"node_names": ["ctc"], "ranks": [0]}],
        "model_kwargs": {"checkpoint_path": str(checkpoint), "seed": 5, "max_batch_size": 8,
                         "max_batch_seconds": 12.0}}), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


def transcribe(oai: openai.OpenAI, audio: bytes, **fields) -> str:
    return oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), **fields).text


def test_openai_client_transcribes(oai: openai.OpenAI) -> None:
    audio = wav(noise_clip(2.0, seed=1))
    text = transcribe(oai, audio)
    assert text and all(w.startswith("w") for w in text.split()), text
    # language, prompt and temperature are taken and change nothing
    assert transcribe(oai, audio, language="sw", prompt="hello", temperature=0.4) == text
    verbose = oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), response_format="verbose_json")
    assert verbose.text == text and verbose.duration == pytest.approx(2.0, abs=0.01)
    assert len(verbose.segments) == 1 and verbose.segments[0].end == pytest.approx(2.0, abs=0.01)


def test_concurrent_requests_equal_their_solo_results(oai: openai.OpenAI) -> None:
    clips = [wav(noise_clip(0.8 + 0.35 * i, seed=10 + i)) for i in range(8)]
    alone = [transcribe(oai, c) for c in clips]
    assert len(set(alone)) == 8
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: transcribe(oai, c), clips))
    assert together == alone


def test_long_upload_is_one_segment_per_window(http) -> None:
    """45 s: three windows of 15 s each (cuts within 5 s of 15 s and 30 s), each transcribed as
    it is alone; srt has one cue per window."""
    audio = noise_clip(45.0, seed=40)
    audio[int(14.0 * 16000):int(14.2 * 16000)] = 0.0
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, "response_format": "verbose_json"},
                         files={"file": ("long.wav", wav(audio), "audio/wav")})
    assert response.status_code == 200, response.text
    segments = response.json()["segments"]
    assert len(segments) == 3 and segments[0]["end"] == pytest.approx(14.1, abs=0.01)
    assert all(s["end"] - s["start"] <= 16.0 for s in segments)
    first = audio[:int(round(segments[0]["end"] * 16000))]
    alone = http.post("/v1/audio/transcriptions", data={"model": MODEL},
                      files={"file": ("a.wav", wav(first), "audio/wav")}).json()["text"]
    assert segments[0]["text"] == alone
    assert response.json()["text"] == " ".join(s["text"] for s in segments if s["text"])
    srt = http.post("/v1/audio/transcriptions", data={"model": MODEL, "response_format": "srt"},
                    files={"file": ("long.wav", wav(audio), "audio/wav")}).text
    assert srt.count(" --> ") == 3


def test_window_seconds_per_request(http) -> None:
    audio = wav(noise_clip(30.0, seed=41))
    response = http.post("/v1/audio/transcriptions",
                         data={"model": MODEL, "response_format": "verbose_json",
                               "model_kwargs": json.dumps({"window_seconds": 40})},
                         files={"file": ("clip.wav", audio, "audio/wav")})
    assert response.status_code == 200 and len(response.json()["segments"]) == 1


def test_a_25_minute_upload_is_a_400_naming_the_limit(http) -> None:
    audio = wav(np.zeros(25 * 60 * 8000, np.float32), rate=8000, subtype="PCM_U8")
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL},
                         files={"file": ("long.wav", audio, "audio/wav")})
    assert response.status_code == 400, response.text
    assert "1200" in response.json()["error"]["message"]


@pytest.mark.parametrize("fields,param", [({"model_kwargs": json.dumps({"window_seconds": 41})}, "window_seconds"),
                                          ({"model_kwargs": json.dumps({"lang": "en"})}, "model_kwargs"),
                                          ({"temperature": "2"}, "temperature")])
def test_bad_fields_are_400_naming_them(http, fields: dict, param: str) -> None:
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, **fields},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=2)), "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_too_short_is_a_400(http) -> None:
    """Shorter than one frame of the tiny encoder (60 samples)."""
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL},
                         files={"file": ("clip.wav", wav(noise_clip(0.002, seed=2)), "audio/wav")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


def test_generate_transcribes_the_same(oai: openai.OpenAI, http) -> None:
    audio = wav(noise_clip(1.5, seed=50))
    response = http.post("/generate", data={"model_kwargs": json.dumps({"language": "de"})},
                         files=[("files", ("clip.wav", audio, "audio/wav"))])
    assert response.status_code == 200, response.text
    assert response.json()["text"] == transcribe(oai, audio)
    long = wav(noise_clip(41.0, seed=51))  # /generate reads a clip whole: over 40 s is refused
    response = http.post("/generate", files=[("files", ("long.wav", long, "audio/wav"))])
    assert response.status_code == 400 and "40 s" in response.json()["error"]["message"], response.text
    response = http.post("/generate", data={"model_kwargs": json.dumps({"whole": False})},
                         files=[("files", ("long.wav", long, "audio/wav"))])
    assert response.status_code == 200, response.text


def test_translation_is_not_served(http) -> None:
    response = http.post("/v1/audio/translations", data={"model": MODEL},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=4)), "audio/wav")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


@pytest.mark.parametrize("size", ["300m", "1b", "3b", "7b"])
def test_reference_yamls_parse(size: str) -> None:
    from pathlib import Path

    import yaml

    from mstar.model.registry import model_class

    config = parse_config(yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" /
                                          f"omnilingual_asr_ctc_{size}.yaml").read_text()))
    spec = model_class(config.model)(config)
    assert spec.size == size and spec.knobs.max_batch_seconds == 320 and spec.graph()
