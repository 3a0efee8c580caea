"""/v1/audio/transcriptions and /v1/audio/translations over a fake transcribing backend:
the official OpenAI client in every response format, form validation, size caps, backend
errors, auth, and the SDK's ``transcribe``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from mstar.audio.io import decode_audio, encode_wav
from mstar.audio.windows import split_at_quiet_points
from mstar.client import MStarClient, MStarError, TranscriptionResult
from mstar.contract import (
    RequestError,
    Transcription,
    TranscriptionSegment,
    TranscriptionSpec,
)
from mstar.server.app import create_app
from mstar.server.audio_routes import MAX_UPLOAD_BYTES
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"


class FakeTranscriber(FakeBackend):
    """The echoing fake plus ``transcribe``: one segment per 30-s window, saying
    "window <i>" (prefixed "[en]" for translations). Records every spec. The prompt
    ``reject`` raises a RequestError (422)."""

    tasks = FakeBackend.tasks | {"transcription", "translation"}

    def __init__(self) -> None:
        super().__init__()
        self.transcribe_specs: list[TranscriptionSpec] = []

    async def transcribe(self, spec: TranscriptionSpec) -> Transcription:
        self.transcribe_specs.append(spec)
        if spec.prompt == "reject":
            raise RequestError("prompt", "the fake backend rejects this prompt", 422)
        audio = decode_audio(spec.audio, max_bytes=MAX_UPLOAD_BYTES, max_seconds=600)
        rate = audio.sample_rate
        prefix = "[en] " if spec.task == "translate" else ""
        segments = [
            TranscriptionSegment(id=i, start=s / rate, end=e / rate, text=f" {prefix}window {i}",
                                 tokens=[i], temperature=spec.temperature or 0.0)
            for i, (s, e) in enumerate(split_at_quiet_points(audio.samples, rate))
        ]  # fmt: skip
        text = "".join(s.text for s in segments).strip()
        return Transcription(text, spec.language or "en", audio.duration, segments)


@pytest.fixture(scope="module")
def transcriber() -> FakeTranscriber:
    return FakeTranscriber()


@pytest.fixture(scope="module")
def live(transcriber: FakeTranscriber) -> Iterator[LiveServer]:
    with LiveServer(create_app(transcriber, served_model_names=[MODEL, "alias"])) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=20)


def _post(live: LiveServer, data: dict | None = None, file: bytes | None = None,
          path: str = "/v1/audio/transcriptions") -> httpx.Response:  # fmt: skip
    files = {"file": ("clip.wav", file)} if file is not None else {"dummy": ("x", b"")}
    return httpx.post(f"{live.url}{path}", data=data or {}, files=files, timeout=30)


def _error(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


# --------------------------------------------------------------- OpenAI client


def test_json(oai: openai.OpenAI, transcriber: FakeTranscriber) -> None:
    with SPEECH.open("rb") as f:
        result = oai.audio.transcriptions.create(model=MODEL, file=f)
    assert result.text == "window 0"
    spec = transcriber.transcribe_specs[-1]
    assert spec.audio == SPEECH.read_bytes() and spec.filename == "speech_en.wav"
    assert (spec.task, spec.language, spec.prompt) == ("transcribe", None, None)
    assert spec.temperature is None


def test_options_reach_the_backend(oai: openai.OpenAI, transcriber: FakeTranscriber) -> None:
    with SPEECH.open("rb") as f:
        oai.audio.transcriptions.create(
            model="alias", file=f, language="English", prompt="a fox", temperature=0.2,
            response_format="verbose_json", timestamp_granularities=["segment"],
        )  # fmt: skip
    spec = transcriber.transcribe_specs[-1]
    assert (spec.language, spec.prompt, spec.temperature) == ("en", "a fox", 0.2)


def test_text_srt_vtt(oai: openai.OpenAI) -> None:
    with SPEECH.open("rb") as f:
        text = oai.audio.transcriptions.create(model=MODEL, file=f, response_format="text")
    assert isinstance(text, str) and text.strip() == "window 0"
    with SPEECH.open("rb") as f:
        srt = oai.audio.transcriptions.create(model=MODEL, file=f, response_format="srt")
    assert re.match(r"1\n00:00:00,000 --> 00:00:08,\d{3}\nwindow 0\n", srt)
    with SPEECH.open("rb") as f:
        vtt = oai.audio.transcriptions.create(model=MODEL, file=f, response_format="vtt")
    assert re.match(r"WEBVTT\n\n00:00:00\.000 --> 00:00:08\.\d{3}\nwindow 0\n", vtt)


def test_verbose_json_long_audio(oai: openai.OpenAI) -> None:
    noise = np.random.default_rng(0).uniform(-0.3, 0.3, 65 * 16000).astype(np.float32)
    result = oai.audio.transcriptions.create(
        model=MODEL, file=("long.wav", encode_wav(noise, 16000)), response_format="verbose_json"
    )
    assert result.language == "english" and result.duration == pytest.approx(65.0)
    assert result.text == "window 0 window 1 window 2"
    segments = result.segments or []
    assert [s.id for s in segments] == [0, 1, 2]
    assert segments[0].start == 0 and segments[-1].end == pytest.approx(65.0)
    assert all(a.end == b.start for a, b in zip(segments, segments[1:]))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # OpenAI deprecated translations
def test_translation(oai: openai.OpenAI, transcriber: FakeTranscriber) -> None:
    with SPEECH.open("rb") as f:
        result = oai.audio.translations.create(model=MODEL, file=f, prompt="p")
    assert result.text == "[en] window 0"
    spec = transcriber.transcribe_specs[-1]
    assert (spec.task, spec.language, spec.prompt) == ("translate", None, "p")
    with SPEECH.open("rb") as f:
        srt = oai.audio.translations.create(model=MODEL, file=f, response_format="srt")
    assert "[en] window 0" in srt


def test_client_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        oai.audio.transcriptions.create(model="nope", file=SPEECH)
    assert "nope" in str(not_found.value)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.audio.transcriptions.create(
            model=MODEL, file=SPEECH, response_format="diarized_json"  # type: ignore[arg-type]
        )


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"response_format": "mp3"}, "response_format"),
        ({"temperature": "1.5"}, "temperature"),
        ({"temperature": "-0.1"}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "nan"}, "temperature"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),
        ({"timestamp_granularities[]": "char"}, "timestamp_granularities[]"),
        ({"model_kwargs": "[1]"}, "model_kwargs"),
    ],
)
def test_bad_fields_are_400(live: LiveServer, data: dict, param: str) -> None:
    _error(_post(live, data, SPEECH.read_bytes()), 400, param)


def test_word_timestamps_message(live: LiveServer) -> None:
    message = _error(_post(live, {"timestamp_granularities[]": "word"}, b"x"), 400,
                     "timestamp_granularities[]")  # fmt: skip
    assert "word timestamps are not supported" in message


def test_unknown_model_is_404(live: LiveServer) -> None:
    response = _post(live, {"model": "whisper-9"}, SPEECH.read_bytes())
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and "whisper-9" in error["message"]


def test_missing_file(live: LiveServer) -> None:
    assert "file is required" in _error(_post(live, {"model": MODEL}), 400, "file")
    as_text = httpx.post(f"{live.url}/v1/audio/transcriptions", files={"file": (None, "hi")})
    _error(as_text, 400, "file")
    not_form = httpx.post(f"{live.url}/v1/audio/transcriptions", json={"file": "x"})
    assert "multipart/form-data" in _error(not_form, 400, "file")


def test_oversize_upload_is_413(live: LiveServer, transcriber: FakeTranscriber) -> None:
    before = len(transcriber.transcribe_specs)
    message = _error(_post(live, {}, b"\0" * (MAX_UPLOAD_BYTES + 1)), 413, "file")
    expected = f"upload is {MAX_UPLOAD_BYTES + 1} bytes; the limit is {MAX_UPLOAD_BYTES} bytes"
    assert message == f"file: {expected}"
    far_over = _post(live, {}, b"\0" * (MAX_UPLOAD_BYTES + 2 * 1024 * 1024))  # refused by header
    _error(far_over, 413, "file")
    assert len(transcriber.transcribe_specs) == before


def test_undecodable_uploads_name_file(live: LiveServer) -> None:
    mp4 = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00\x00\x00\x08moov" * 8
    assert "video container, not audio" in _error(_post(live, {}, mp4), 400, "file")
    assert "file is empty" in _error(_post(live, {}, b""), 400, "file")
    assert "could not decode audio" in _error(_post(live, {}, b"garbage" * 50), 400, "file")


def test_backend_request_error(live: LiveServer) -> None:
    response = _post(live, {"prompt": "reject"}, SPEECH.read_bytes())
    assert response.status_code == 422 and response.json()["error"]["param"] == "prompt"


def test_a_model_that_does_not_transcribe_refuses_the_routes() -> None:
    plain = TestClient(create_app(FakeBackend()))
    refused = plain.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"x")})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    secured = TestClient(create_app(FakeTranscriber(), api_key="k"))
    upload = {"file": ("a.wav", SPEECH.read_bytes())}
    assert secured.post("/v1/audio/transcriptions", files=upload).status_code == 401
    ok = secured.post("/v1/audio/translations", files=upload, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200 and ok.json() == {"text": "[en] window 0"}


# ------------------------------------------------------------------------ SDK


@pytest.fixture(scope="module")
def sdk(live: LiveServer) -> Iterator[MStarClient]:
    with MStarClient(live.url, timeout=20) as client:
        yield client


def test_sdk_transcribe(sdk: MStarClient, transcriber: FakeTranscriber) -> None:
    result = sdk.transcribe(SPEECH, language="en", temperature=0.5)
    assert isinstance(result, TranscriptionResult) and result.text == "window 0"
    assert result.raw == {"text": "window 0"} and result.segments == []
    spec = transcriber.transcribe_specs[-1]
    assert (spec.language, spec.temperature, spec.filename) == ("en", 0.5, "speech_en.wav")
    verbose = sdk.transcribe(str(SPEECH), response_format="verbose_json", model="alias")
    assert verbose.language == "english" and 8 < (verbose.duration or 0) < 9.5
    assert [s["text"] for s in verbose.segments] == [" window 0"]


def test_sdk_formats_and_translate(sdk: MStarClient, transcriber: FakeTranscriber) -> None:
    srt = sdk.transcribe(SPEECH.read_bytes(), response_format="srt", filename="x.wav")
    assert srt.text.startswith("1\n00:00:00,000 --> ") and srt.raw == srt.text
    assert transcriber.transcribe_specs[-1].filename == "x.wav"
    translated = sdk.transcribe(SPEECH, translate=True, response_format="text")
    assert translated.text == "[en] window 0\n"
    assert transcriber.transcribe_specs[-1].task == "translate"
    with pytest.raises(ValueError, match="language"):
        sdk.transcribe(SPEECH, translate=True, language="de")


def test_sdk_errors(sdk: MStarClient) -> None:
    with pytest.raises(MStarError) as bad:
        sdk.transcribe(SPEECH, response_format="mp3")
    assert bad.value.status == 400 and bad.value.param == "response_format"
    with pytest.raises(MStarError) as missing:
        sdk.transcribe(SPEECH, model="nope")
    assert missing.value.status == 404 and missing.value.param == "model"
