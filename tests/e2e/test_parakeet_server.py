"""End to end: ``mstar serve parakeet`` (the real CLI in a subprocess, worker processes, CPU)
over a tiny Parakeet TDT checkpoint in a hub-cache layout, with ``load_format: dummy``
weights. The official ``openai`` client transcribes; 8 concurrent requests give exactly
what each gives alone; a client that disconnects gives its decoder state slot back; long
uploads are cut into windows at quiet points; a language Parakeet does not know is a 400
naming ``language``; /generate and the SDK transcribe the same."""

from __future__ import annotations

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
import yaml
from client_hangup import hang_up_when
from live_server import Server, serve_offline

from mstar.client import MStarClient
from tests.support.fastconformer import M4A, hub_cache, noise_clip, wav

MODEL = "parakeet"
MAX_CLIP_S = 4.0
REQUEST_TIMEOUT_S = 60.0




@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("parakeet-server")
    hub_cache(workdir / "hub")
    config = {"model": MODEL, "cache_dir": str(workdir / "hub"), "load_format": "dummy",
              "max_concurrent_requests": 8, "resources": {"transducer_state": {"max_slots": 9}},
              "model_kwargs": {"steps_per_iteration": 4, "max_clip_seconds": MAX_CLIP_S}}
    with serve_offline(MODEL, workdir, config) as live:
        yield live


def transcribe(oai: openai.OpenAI, audio: bytes, **fields) -> str:
    return oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), **fields).text


def slots_used(http: httpx.Client) -> tuple[float, float]:
    """``(state slots in use, requests running or waiting)`` from /metrics."""
    text = http.get("/metrics").text
    slots = re.search(r'^mstar_transducer_slots_used\{[^}]*node="decoder"[^}]*\} (\S+)$', text, re.M)
    running = re.search(r"^mstar_requests_running (\S+)$", text, re.M)
    waiting = re.search(r"^mstar_requests_waiting (\S+)$", text, re.M)
    assert slots and running and waiting, text[-2000:]
    return float(slots.group(1)), float(running.group(1)) + float(waiting.group(1))


def wait_drained(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (state := slots_used(http)) != (0.0, 0.0):
        assert time.monotonic() < deadline, f"slots in use / requests running or waiting: {state}"
        time.sleep(0.1)


def test_openai_client_transcribes(oai: openai.OpenAI, http: httpx.Client) -> None:
    audio = wav(noise_clip(2.0, seed=1))
    text = transcribe(oai, audio)
    assert text and re.fullmatch(r"(w\d+ ?)+", text), text  # the tiny tokenizer's words
    assert transcribe(oai, audio, language="en") == text  # a known language is taken (and not needed)
    verbose = oai.audio.transcriptions.create(model=MODEL, file=("clip.wav", audio), response_format="verbose_json")
    assert verbose.text == text and verbose.duration == pytest.approx(2.0, abs=0.01)
    wait_drained(http)


def test_concurrent_requests_equal_their_solo_results(oai: openai.OpenAI, http: httpx.Client) -> None:
    clips = [wav(noise_clip(0.8 + 0.35 * i, seed=10 + i)) for i in range(8)]
    alone = [transcribe(oai, c) for c in clips]
    assert len(set(alone)) == 8
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: transcribe(oai, c), clips))
    assert together == alone
    wait_drained(http)


def test_disconnect_frees_the_state_slot(server: Server, http: httpx.Client, oai: openai.OpenAI) -> None:
    long = wav(noise_clip(600.0, seed=30))  # 150+ windows, 8 at a time: seconds of decoding
    hang_up_when(server.url, "/v1/audio/transcriptions", lambda: slots_used(http)[0] > 0,
                 data={"model": MODEL}, files={"file": ("long.wav", long, "audio/wav")})
    wait_drained(http)
    assert "client disconnected; cancelling the request" in server.log_tail(20000)
    assert transcribe(oai, wav(noise_clip(1.0, seed=31)))  # the server carries on
    assert server.proc.poll() is None


def test_long_upload_is_windowed_at_quiet_points(http: httpx.Client) -> None:
    """7 s: speech-like noise, 0.4 s of silence from 3.2 s, noise again: the 4 s window limit
    cuts inside the silence, and each window is transcribed as it is alone."""
    first, second = noise_clip(3.2, seed=40), noise_clip(3.4, seed=41)
    audio = np.concatenate([first, np.zeros(int(0.4 * 16000), np.float32), second])
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, "response_format": "verbose_json"},
                         files={"file": ("long.wav", wav(audio), "audio/wav")})
    assert response.status_code == 200, response.text
    segments = response.json()["segments"]
    assert len(segments) == 2
    cut = segments[0]["end"]
    assert 3.2 <= cut <= 3.6 and segments[1]["start"] == cut
    assert all(s["end"] - s["start"] <= MAX_CLIP_S for s in segments)
    halves = [audio[: int(round(cut * 16000))], audio[int(round(cut * 16000)):]]
    texts = [http.post("/v1/audio/transcriptions", data={"model": MODEL},
                       files={"file": ("half.wav", wav(h), "audio/wav")}).json()["text"] for h in halves]
    assert [s["text"] for s in segments] == texts
    assert response.json()["text"] == " ".join(texts)


@pytest.mark.parametrize("fields,param", [({"language": "ja"}, "language"), ({"language": "klingon"}, "language"),
                                          ({"temperature": "0.5"}, "temperature"),
                                          ({"model_kwargs": json.dumps({"lang": "en"})}, "model_kwargs"),
                                          ({"model_kwargs": json.dumps({"language": "xx"})}, "language")])
def test_bad_fields_are_400_naming_them(http: httpx.Client, fields: dict, param: str) -> None:
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL, **fields},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=2)), "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_openai_client_sees_the_language_error(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="language"):
        transcribe(oai, wav(noise_clip(0.5, seed=3)), language="ja")


def test_generate_and_sdk_transcribe_the_same(server: Server, http: httpx.Client, oai: openai.OpenAI) -> None:
    audio = wav(noise_clip(1.5, seed=50))
    text = transcribe(oai, audio)
    response = http.post("/generate", data={"model_kwargs": json.dumps({"language": "de"})},
                         files=[("files", ("clip.wav", audio, "audio/wav"))])
    assert response.status_code == 200, response.text
    assert response.json()["text"] == text
    bad = http.post("/generate", data={"model_kwargs": json.dumps({"language": "zz"})},
                    files=[("files", ("clip.wav", audio, "audio/wav"))])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "language"
    with MStarClient(server.url, timeout=REQUEST_TIMEOUT_S) as sdk:
        assert sdk.transcribe(audio, filename="clip.wav").text == text


def test_routes_it_does_not_serve(http: httpx.Client) -> None:
    response = http.post("/v1/audio/translations", data={"model": MODEL},
                         files={"file": ("clip.wav", wav(noise_clip(0.5, seed=4)), "audio/wav")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_reference_yaml_parses() -> None:
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "parakeet.yaml").read_text())
    assert config["resources"]["transducer_state"]["max_slots"] == config["max_concurrent_requests"] + 1




def test_a_container_it_cannot_decode_is_400_naming_the_format(http: httpx.Client) -> None:
    response = http.post("/v1/audio/transcriptions", data={"model": MODEL},
                         files={"file": ("voice.m4a", M4A, "audio/mp4")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and "M4A" in error["message"]
