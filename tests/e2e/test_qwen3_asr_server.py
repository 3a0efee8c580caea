"""End to end: ``mstar serve qwen3_asr`` (the real CLI in a subprocess) over a tiny checkpoint
in the released layout in a hub-cache directory, ``load_format: dummy``. The official
``openai`` client transcribes (language detected, or forced with ``language``; the OpenAI
``prompt`` as context); /generate gives the same text; 8 concurrent requests give exactly what
each gives alone; the 20-minute limit: a 25-minute upload is a 400 naming it, while a
20-minute clip's prompt fits the deployment; bad fields are 400s naming them.

Dummy weights make the tiny LLM repeat a token whatever the audio, so these tests pin the
serving path, not the numbers (the numbers are pinned in tests/model/test_qwen3_asr_parity.py)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
from live_server import Server, serve_offline

from mstar.config import parse_config
from mstar.model.registry import model_class
from tests.support.fastconformer import noise_clip, wav
from tests.support.qwen3_asr import write_hub

MODEL = "qwen3_asr"
CONFIG = {"model": MODEL, "load_format": "dummy", "max_seq_len": 16384, "max_concurrent_requests": 8,
          "resources": {"kv_cache": {"max_num_pages": 8192, "page_size": 16}},
          "model_kwargs": {"max_new_tokens": 6}}
LANGUAGES = [None, "de", None, "en", None, "German", None, None]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("qwen3-asr-hub")
    write_hub(root, "Qwen/Qwen3-ASR-1.7B")
    return root


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve_offline(MODEL, tmp_path_factory.mktemp("qwen3-asr-server"), CONFIG | {"cache_dir": str(hub)}) as live:
        yield live


def transcribe(oai: openai.OpenAI, audio: bytes, language: str | None = None, **fields):
    if language:
        fields["extra_body"] = {"model_kwargs": json.dumps({"language": language})}
    return oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), **fields)


def test_openai_client_transcribes_detected_or_forced(server: Server, oai: openai.OpenAI,
                                                      http: httpx.Client) -> None:
    audio = wav(noise_clip(2.0, seed=1))
    text = transcribe(oai, audio).text
    assert isinstance(text, str) and text
    forced = oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), language="de",
                                             response_format="verbose_json")
    assert forced.language == "german" and isinstance(forced.text, str)
    assert isinstance(transcribe(oai, audio, prompt="w5 w6").text, str)
    response = http.post("/generate", files=[("files", ("clip.wav", audio, "audio/wav"))])
    assert response.status_code == 200, response.text
    assert response.json()["text"] == text


def test_concurrent_requests_equal_their_solo_results(oai: openai.OpenAI) -> None:
    clips = [wav(noise_clip(0.3 + 0.4 * i, seed=10 + i)) for i in range(8)]
    alone = [transcribe(oai, c, lang).text for c, lang in zip(clips, LANGUAGES)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda args: transcribe(oai, *args).text, zip(clips, LANGUAGES)))
    assert together == alone


def test_a_25_minute_upload_is_400_naming_the_limit(http: httpx.Client) -> None:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(25 * 60 * 8000, dtype=np.int16), 8000, format="WAV", subtype="PCM_16")
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL},
                         files={"file": ("long.wav", buf.getvalue(), "audio/wav")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and "1200" in error["message"], error


def test_a_20_minute_clip_fits_one_prompt(hub) -> None:
    spec = model_class(MODEL)(parse_config(CONFIG | {"cache_dir": str(hub)}))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        spec.load_frontend()
    request = spec.clip_request(torch.zeros(20 * 60 * 16000), "", None)
    assert request.inputs["prompt_ids"].numel() > 20 * 60 * 13


@pytest.mark.parametrize("fields,param", [({"language": "tlh"}, "language"),
                                          ({"model_kwargs": json.dumps({"language": "xx"})}, "language"),
                                          ({"model_kwargs": json.dumps({"instruction": "x"})}, "model_kwargs"),
                                          ({"temperature": "0.5"}, "temperature")])
def test_bad_fields_are_400_naming_them(http: httpx.Client, fields: dict, param: str) -> None:
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, **fields},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=2)), "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_translation_is_400_naming_model(http: httpx.Client) -> None:
    response = http.post("/v1/audio/translations", data={"model": MODEL},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=3)))})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


@pytest.mark.parametrize("key", ["qwen3_asr", "qwen3_asr_realtime"])
def test_shipped_yaml_holds_its_longest_clip_and_request_cap(hub, key: str) -> None:
    from pathlib import Path

    from mstar.config import load_config

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / f"{key}.yaml")
    spec = model_class(key)(config.model_copy(update={"cache_dir": str(hub), "load_format": "dummy",
                                                       "model_path": str(hub / "models--Qwen--Qwen3-ASR-1.7B"
                                                                         / "snapshots" / ("b" * 40))}))
    assert spec.default_capacity() == {"kv_pages": config.max_concurrent_requests * config.max_seq_len // 16}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        spec.load_frontend()  # refuses a max_seq_len that cannot hold max_audio_seconds


def test_a_max_seq_len_short_of_20_minutes_is_refused(hub) -> None:
    from mstar.config import ConfigError

    spec = model_class(MODEL)(parse_config(CONFIG | {"cache_dir": str(hub), "max_seq_len": 15000}))
    with pytest.MonkeyPatch.context() as env, pytest.raises(ConfigError, match="max_seq_len"):
        env.setenv("HF_HUB_OFFLINE", "1")
        spec.load_frontend()
