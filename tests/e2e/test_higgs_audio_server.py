"""End to end: ``mstar serve higgs_audio`` (the real CLI in a subprocess) over a tiny
checkpoint in the release's layout in a hub-cache directory, ``load_format: dummy``. The
official ``openai`` client transcribes (the OpenAI prompt ignored, an ``instruction`` taken);
/generate and the SDK give the same text; 8 concurrent requests give exactly what each gives
alone; a 25-minute upload is a 400 naming the 20-minute limit; bad fields are 400s naming them;
the shipped YAML's pool holds its request cap.

Dummy weights make the tiny LLM say much the same whatever the audio, so these tests pin the
serving path, not the numbers: the transcripts of tiny real weights, several requests batched
together, are pinned to the reference in tests/model/test_higgs_audio_checkpoint.py."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from live_server import Server, serve_offline

from mstar.client import MStarClient
from mstar.config import load_config
from mstar.model.registry import model_class
from tests.support.fastconformer import noise_clip, wav
from tests.support.higgs_audio import write_higgs_audio

MODEL = "higgs_audio"
REQUEST_TIMEOUT_S = 60.0
INSTRUCTIONS = [None, "Say what you hear .", None, "w5 w6", None, None, "Say what you hear .", None]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("higgs-audio-server")
    write_higgs_audio(workdir / "hub")
    config = {"model": MODEL, "cache_dir": str(workdir / "hub"), "load_format": "dummy", "max_seq_len": 96,
              "max_concurrent_requests": 8, "resources": {"kv_cache": {"max_num_pages": 192, "page_size": 4}},
              "model_kwargs": {"max_new_tokens": 6, "max_clip_seconds": 4.0}}
    with serve_offline(MODEL, workdir, config) as live:
        yield live


def transcribe(oai: openai.OpenAI, audio: bytes, instruction: str | None = None, **fields) -> str:
    if instruction:
        fields["extra_body"] = {"model_kwargs": json.dumps({"instruction": instruction})}
    return oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), **fields).text


def in_use(http: httpx.Client) -> tuple[float, ...]:
    """KV pages held by the LLM, and requests running or waiting."""
    text = http.get("/metrics").text
    pages = float(re.search(r'^mstar_kv_pages_used\{[^}]*node="decoder"[^}]*\} (\S+)$', text, re.M).group(1))
    live = [float(m) for m in re.findall(r"^mstar_requests_(?:running|waiting) (\S+)$", text, re.M)]
    return pages, sum(live)


def wait_drained(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(state := in_use(http)):
        assert time.monotonic() < deadline, f"pages / requests still held: {state}"
        time.sleep(0.1)


def test_openai_client_transcribes(server: Server, oai: openai.OpenAI, http: httpx.Client) -> None:
    audio = wav(noise_clip(2.0, seed=1))
    text = transcribe(oai, audio)
    assert isinstance(text, str) and text
    assert transcribe(oai, audio, language="en", prompt="the OpenAI prompt is ignored") == text
    assert isinstance(transcribe(oai, audio, "Say what you hear ."), str)
    verbose = oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), response_format="verbose_json",
                                              language="en")
    assert verbose.text == text and verbose.language == "english" and abs(verbose.duration - 2.0) < 1e-3
    response = http.post("/generate", data={"text": "unused"}, files=[("files", ("clip.wav", audio, "audio/wav"))])
    assert response.status_code == 200, response.text
    assert response.json()["text"] == text
    with MStarClient(server.url, timeout=REQUEST_TIMEOUT_S) as sdk:
        assert sdk.transcribe(audio, filename="clip.wav").text == text
    wait_drained(http)


def test_concurrent_requests_equal_their_solo_results(oai: openai.OpenAI, http: httpx.Client) -> None:
    clips = [wav(noise_clip(0.8 + 0.3 * i, seed=10 + i)) for i in range(8)]
    alone = [transcribe(oai, c, i) for c, i in zip(clips, INSTRUCTIONS)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda args: transcribe(oai, *args), zip(clips, INSTRUCTIONS)))
    assert together == alone
    wait_drained(http)


def test_a_25_minute_upload_is_400_naming_the_limit(http: httpx.Client) -> None:
    buf = io.BytesIO()  # 8 kHz 8-bit: 12 MB, under the 25 MB upload limit
    sf.write(buf, np.zeros(25 * 60 * 8000, np.float32), 8000, format="WAV", subtype="PCM_U8")
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL},
                         files={"file": ("long.wav", buf.getvalue(), "audio/wav")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and "the limit is 1200 s" in error["message"], error


@pytest.mark.parametrize("fields,param", [({"model_kwargs": json.dumps({"instruction": ""})}, "instruction"),
                                          ({"model_kwargs": json.dumps({"target_language": "en"})}, "model_kwargs"),
                                          ({"temperature": "0.5"}, "temperature")])
def test_bad_fields_are_400_naming_them(http: httpx.Client, fields: dict, param: str) -> None:
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, **fields},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=2)), "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_bad_generate_and_translation_requests_are_400(http: httpx.Client) -> None:
    audio = wav(noise_clip(0.5, seed=3))
    bad = http.post("/generate", data={"model_kwargs": json.dumps({"instruction": ""})},
                    files=[("files", ("clip.wav", audio, "audio/wav"))])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "instruction"
    response = http.post("/v1/audio/translations", data={"model": MODEL}, files={"file": ("clip.wav", audio)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    tiny = http.post("/v1/audio/transcriptions", data={"model": MODEL},
                     files={"file": ("clip.wav", wav(np.zeros(200, np.float32)), "audio/wav")})
    assert tiny.status_code == 400 and tiny.json()["error"]["param"] == "file"


def test_reference_yaml_holds_its_request_cap() -> None:
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "higgs_audio.yaml")
    assert model_class(MODEL)(config).default_capacity() == {
        "kv_pages": config.max_concurrent_requests * config.max_seq_len // 16}
