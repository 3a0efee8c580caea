"""End to end: ``mstar serve nemotron_asr`` (the real CLI in a subprocess) over a tiny
Nemotron ASR checkpoint in a hub-cache layout, ``load_format: dummy``, at a lookahead set in
the YAML. The official ``openai`` client transcribes with a language prompt (a locale, a bare
code or auto); 8 concurrent requests of mixed languages give exactly what each gives alone;
a client that disconnects gives its state slot back; an unknown language is a 400 naming
``language``."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from client_hangup import hang_up_when
from live_server import Server, serve_offline

from tests.support.fastconformer import hub_cache, noise_clip, wav

MODEL = "nemotron_asr"
REQUEST_TIMEOUT_S = 60.0
LANGUAGES = ["en-US", "de", "auto", None, "fr-FR", "pt-BR", "es", "en-GB"]




@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("nemotron-asr-server")
    hub_cache(workdir / "hub")
    config = {"model": MODEL, "cache_dir": str(workdir / "hub"), "load_format": "dummy",
              "max_concurrent_requests": 8, "resources": {"transducer_state": {"max_slots": 9}},
              "model_kwargs": {"steps_per_iteration": 4, "lookahead": 6, "max_clip_seconds": 4.0}}
    with serve_offline(MODEL, workdir, config) as live:
        yield live


def transcribe(oai: openai.OpenAI, audio: bytes, language: str | None = None) -> str:
    extra = {"language": language} if language else {}
    return oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), **extra).text


def in_use(http: httpx.Client) -> tuple[float, float]:
    text = http.get("/metrics").text
    slots = re.search(r'^mstar_transducer_slots_used\{[^}]*\} (\S+)$', text, re.M)
    live = [float(m) for m in re.findall(r"^mstar_requests_(?:running|waiting) (\S+)$", text, re.M)]
    assert slots and len(live) == 2, text[-2000:]
    return float(slots.group(1)), sum(live)


def wait_drained(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (state := in_use(http)) != (0.0, 0.0):
        assert time.monotonic() < deadline, f"slots in use / requests live: {state}"
        time.sleep(0.1)


def test_openai_client_transcribes_with_a_language_prompt(oai: openai.OpenAI, http: httpx.Client) -> None:
    audio = wav(noise_clip(2.0, seed=1))
    texts = {language: transcribe(oai, audio, language) for language in ("en-US", "en", "auto", None, "ja-JP")}
    assert all(re.fullmatch(r"(w\d+ ?)*", t) for t in texts.values()), texts
    assert texts["en-US"] == texts["en"]  # the bare code is the locale
    assert texts["auto"] == texts[None]  # auto is the default
    wait_drained(http)


def test_concurrent_requests_equal_their_solo_results(oai: openai.OpenAI, http: httpx.Client) -> None:
    clips = [wav(noise_clip(0.7 + 0.3 * i, seed=10 + i)) for i in range(8)]
    alone = [transcribe(oai, c, lang) for c, lang in zip(clips, LANGUAGES)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda pair: transcribe(oai, *pair), zip(clips, LANGUAGES)))
    assert together == alone
    wait_drained(http)


def test_disconnect_frees_the_state_slot(server: Server, http: httpx.Client, oai: openai.OpenAI) -> None:
    long = wav(noise_clip(600.0, seed=30))  # 150+ windows, 8 at a time: seconds of decoding
    hang_up_when(server.url, "/v1/audio/transcriptions", lambda: in_use(http)[0] > 0,
                 data={"model": MODEL}, files={"file": ("long.wav", long, "audio/wav")})
    wait_drained(http)
    assert "client disconnected; cancelling the request" in server.log_tail(20000)
    assert transcribe(oai, wav(noise_clip(1.0, seed=31)), "de") is not None


@pytest.mark.parametrize("language", ["xx-YY", "klingon", "en_US"])
def test_unknown_language_is_400_naming_it(http: httpx.Client, language: str) -> None:
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, "language": language},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=2)), "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "language"
