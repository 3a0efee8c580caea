"""End to end: ``mstar serve canary`` (the real CLI in a subprocess) over a tiny Canary
checkpoint in a hub-cache layout, ``load_format: dummy``. The official ``openai`` client
transcribes and translates; 8 concurrent requests (different languages and targets) give
exactly what each gives alone; a client that disconnects gives its KV pages and cross-attention
K/V back; bad language fields are 400s naming them."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from client_hangup import hang_up_when
from live_server import Server, serve_offline

from tests.support.fastconformer import CANARY_REPO, noise_clip, snapshot_dir, wav, write_canary

MODEL = "canary"
REQUEST_TIMEOUT_S = 60.0
# (language, target_language) of the concurrent requests
TASKS = [("en", None), ("de", None), ("de", "en"), ("en", "fr"), ("fr", None), ("en", "es"), ("uk", "en"), ("it", None)]




@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("canary-server")
    write_canary(snapshot_dir(workdir / "hub", CANARY_REPO))
    config = {"model": MODEL, "cache_dir": str(workdir / "hub"), "load_format": "dummy",
              "max_concurrent_requests": 8, "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 4}},
              "model_kwargs": {"max_new_tokens": 16, "max_clip_seconds": 4.0}}
    with serve_offline(MODEL, workdir, config) as live:
        yield live


def transcribe(oai: openai.OpenAI, audio: bytes, language: str | None = None, target: str | None = None) -> str:
    extra = {"language": language} if language else {}
    if target:
        extra["extra_body"] = {"model_kwargs": json.dumps({"target_language": target})}
    return oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), **extra).text


def in_use(http: httpx.Client) -> tuple[float, ...]:
    """KV pages and cross-attention K/V held by the decoder, and requests running or waiting."""
    text = http.get("/metrics").text
    held = [float(re.search(rf'^mstar_{name}\{{[^}}]*node="decoder"[^}}]*\}} (\S+)$', text, re.M).group(1))
            for name in ("kv_pages_used", "cross_kv_held")]
    live = [float(m) for m in re.findall(r"^mstar_requests_(?:running|waiting) (\S+)$", text, re.M)]
    return (*held, sum(live))


def wait_drained(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(state := in_use(http)):
        assert time.monotonic() < deadline, f"pages / cross K/V / requests still held: {state}"
        time.sleep(0.1)


def test_openai_client_transcribes_and_translates(oai: openai.OpenAI, http: httpx.Client) -> None:
    audio = wav(noise_clip(2.0, seed=1))
    text = transcribe(oai, audio)
    assert isinstance(text, str)
    assert transcribe(oai, audio, "en") == text  # English is the default
    translated = oai.audio.translations.create(model=MODEL, file=("clip.wav", audio),
                                               extra_body={"model_kwargs": json.dumps({"language": "de"})})
    assert translated.text == transcribe(oai, audio, "de", "en")  # the translation route: to English
    wait_drained(http)


def test_concurrent_requests_equal_their_solo_results(oai: openai.OpenAI, http: httpx.Client) -> None:
    clips = [wav(noise_clip(0.8 + 0.3 * i, seed=10 + i)) for i in range(8)]
    alone = [transcribe(oai, c, *task) for c, task in zip(clips, TASKS)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda args: transcribe(oai, args[0], *args[1]), zip(clips, TASKS)))
    assert together == alone
    wait_drained(http)


def test_disconnect_frees_pages_and_cross_kv(server: Server, http: httpx.Client, oai: openai.OpenAI) -> None:
    long = wav(noise_clip(600.0, seed=30))  # 150+ windows, 8 at a time: seconds of decoding
    hang_up_when(server.url, "/v1/audio/transcriptions", lambda: in_use(http)[0] > 0,
                 data={"model": MODEL}, files={"file": ("long.wav", long, "audio/wav")})
    wait_drained(http)
    assert "client disconnected; cancelling the request" in server.log_tail(20000)
    assert isinstance(transcribe(oai, wav(noise_clip(1.0, seed=31)), "de"), str)


@pytest.mark.parametrize("fields,param", [({"language": "ja"}, "language"),
                                          ({"model_kwargs": json.dumps({"target_language": "zz"})},
                                           "target_language"),
                                          ({"language": "de", "model_kwargs": json.dumps({"target_language": "fr"})},
                                           "target_language")])
def test_bad_language_fields_are_400_naming_them(http: httpx.Client, fields: dict, param: str) -> None:
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, **fields},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=2)), "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
