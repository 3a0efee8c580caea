"""/v1/audio/speech and /v1/audio/voices over a fake speaking backend: the official
OpenAI client (whole and streamed), every response format, validation errors, backend
errors before and after the audio starts, cancellation on disconnect, /generate with
audio output, and the SDK's ``tts`` / ``voices``."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from mstar.audio.encode import mp3_supported
from mstar.client import MStarClient, MStarError, SpeechResult, SpeechStream
from mstar.contract import GenerateSpec, OutputEvent, RequestError, SpeechSpec
from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer, wait_until

RATE = 24000
SINE = (0.5 * np.sin(2 * np.pi * 440 * np.arange(RATE // 2) / RATE)).astype(np.float32)
PCM16_ATOL = 1.01 / 32767  # int16 rounding, plus libsndfile's 32768 read scale
VOICES = ["tara", "leo"]


class FakeSpeaker(FakeBackend):
    """The echoing fake plus ``speech``: 3 chunks of a 440 Hz sine at 24 kHz. Inputs:
    ``bad`` raises RequestError (422) on the first advance, ``explode`` fails after the
    first chunk, ``forever`` streams without end. Records specs and cancellations."""

    sample_rate = RATE
    tasks = FakeBackend.tasks | {"speech"}

    def __init__(self) -> None:
        super().__init__()
        self.speech_specs: list[SpeechSpec] = []
        self.speech_cancelled: list[str] = []  # inputs of requests closed before the end

    def voices(self) -> list[str]:
        return list(VOICES)

    async def speech(self, spec: SpeechSpec) -> AsyncIterator[OutputEvent]:
        self.speech_specs.append(spec)
        if spec.input == "bad":
            raise RequestError("input", "the fake backend rejects this text", 422)
        finished = False
        try:
            if spec.input == "forever":
                while True:
                    await asyncio.sleep(0.01)
                    yield OutputEvent(modality="audio", data=SINE[:480].tobytes())
            async for event in _sine_events(explode=spec.input == "explode"):
                yield event
            finished = True
        finally:
            if not finished:
                self.speech_cancelled.append(spec.input)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[OutputEvent]:
        if spec.output_modalities != ["audio"]:
            async for event in super().generate(spec):
                yield event
            return
        self.generate_specs.append(spec)
        async for event in _sine_events():
            yield event


async def _sine_events(explode: bool = False) -> AsyncIterator[OutputEvent]:
    for i, chunk in enumerate(np.array_split(SINE, 3)):
        await asyncio.sleep(0)
        if explode and i == 1:
            raise RuntimeError("the fake backend exploded mid-speech")
        finish = "stop" if i == 2 else None
        yield OutputEvent(modality="audio", data=chunk.tobytes(), finish_reason=finish)


@pytest.fixture(scope="module")
def speaker() -> FakeSpeaker:
    return FakeSpeaker()


@pytest.fixture(scope="module")
def live(speaker: FakeSpeaker) -> Iterator[LiveServer]:
    with LiveServer(create_app(speaker, served_model_names=[MODEL, "alias"])) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def sdk(live: LiveServer) -> Iterator[MStarClient]:
    with MStarClient(live.url, timeout=20) as client:
        yield client


def _assert_sine(data: bytes, fmt: str | None = None) -> None:
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", format=fmt)
    assert rate == RATE and samples.shape == SINE.shape
    np.testing.assert_allclose(samples, SINE, atol=PCM16_ATOL)


def _speech(live: LiveServer, **body: object) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/audio/speech", json=body, timeout=20)


def _error(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


# --------------------------------------------------------------- OpenAI client


def test_wav(oai: openai.OpenAI, speaker: FakeSpeaker) -> None:
    response = oai.audio.speech.create(model=MODEL, voice="tara", input="Hello there.")
    assert response.response.headers["content-type"] == "audio/wav"
    assert response.response.headers["x-sample-rate"] == str(RATE)
    _assert_sine(response.content)
    spec = speaker.speech_specs[-1]
    assert (spec.input, spec.voice, spec.speed, spec.model_kwargs) == ("Hello there.", "tara", 1.0, {})


def test_streaming_response_whole_and_chunked(oai: openai.OpenAI) -> None:
    streamed = oai.audio.speech.with_streaming_response
    with streamed.create(model="alias", voice="leo", input="Hi.", stream_format="audio") as r:
        whole = b"".join(r.iter_bytes())
    with streamed.create(model=MODEL, voice="leo", input="Hi.", extra_body={"stream": True}) as r:
        assert r.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in r.headers
        chunks = list(r.iter_bytes())
    audio = b"".join(chunks)
    assert struct.unpack_from("<I", audio, 40)[0] == 0xFFFFFFFF  # unknown length, like OpenAI
    assert audio[44:] == whole[44:]
    _assert_sine(audio)
    _assert_sine(whole)


def _sse_events(lines: Iterator[str]) -> list[dict]:
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert events and all(e["type"] == "speech.audio.delta" for e in events[:-1])
    assert events[-1]["type"] == "speech.audio.done"
    return events


def test_sse_stream_format(oai: openai.OpenAI) -> None:
    """OpenAI's SSE speech stream: base64 deltas in the response format, joined equal to the
    streamed file, then a done event with the usage."""
    streamed = oai.audio.speech.with_streaming_response
    for fmt in ("pcm", "wav"):
        with streamed.create(model=MODEL, voice="tara", input="sse", response_format=fmt, stream_format="sse") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-sample-rate"] == str(RATE)
            events = _sse_events(r.iter_lines())
        audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
        assert len(events) > 2  # the audio arrived in pieces, as produced
        usage = events[-1]["usage"]
        assert set(usage) == {"input_tokens", "output_tokens", "total_tokens"}
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        streamed_bytes = oai.audio.speech.create(model=MODEL, voice="tara", input="sse", response_format=fmt,
                                                 extra_body={"stream": True}).content
        assert audio == streamed_bytes
    np.testing.assert_array_equal(np.frombuffer(audio[44:], "<i2"), np.rint(SINE * 32767).astype("<i2"))


def test_sse_stream_failure_drops_the_connection(live: LiveServer, speaker: FakeSpeaker) -> None:
    body = {"model": MODEL, "input": "explode", "stream_format": "sse"}
    with httpx.stream("POST", f"{live.url}/v1/audio/speech", json=body, timeout=10) as r:
        assert r.status_code == 200
        with pytest.raises(httpx.TransportError):  # no done event: the transfer breaks
            for _ in r.iter_lines():
                pass
    body = {"model": MODEL, "input": "forever", "stream_format": "sse", "response_format": "pcm"}
    with httpx.stream("POST", f"{live.url}/v1/audio/speech", json=body, timeout=10) as r:
        assert next(r.iter_lines()).startswith("data: ")
    assert wait_until(lambda: speaker.speech_cancelled.count("forever") >= 1, timeout=5)


def test_pcm(oai: openai.OpenAI) -> None:
    for extra in ({}, {"stream": True}):
        data = oai.audio.speech.create(
            model=MODEL, voice="tara", input="pcm", response_format="pcm", extra_body=extra
        ).content
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), np.rint(SINE * 32767).astype("<i2"))


def test_flac(oai: openai.OpenAI) -> None:
    for extra in ({}, {"stream": True}):
        response = oai.audio.speech.create(
            model=MODEL, voice="tara", input="flac", response_format="flac", extra_body=extra
        )
        assert response.response.headers["content-type"] == "audio/flac"
        _assert_sine(response.content)


@pytest.mark.skipif(not mp3_supported(), reason="this libsndfile cannot write MP3")
def test_mp3(oai: openai.OpenAI) -> None:
    response = oai.audio.speech.create(model=MODEL, voice="tara", input="mp3", response_format="mp3")
    assert response.response.headers["content-type"] == "audio/mpeg"
    samples, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    assert rate == RATE and abs(len(samples) - len(SINE)) < RATE // 10
    assert np.sqrt(np.mean(samples**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


def test_sampling_options_reach_the_backend(oai: openai.OpenAI, speaker: FakeSpeaker) -> None:
    extra = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 7, "max_tokens": 99}
    oai.audio.speech.create(model=MODEL, voice={"id": "leo"}, input="x", speed=1.0, extra_body=extra)
    spec = speaker.speech_specs[-1]
    assert spec.model_kwargs == extra and spec.voice == "leo"


def test_voices(live: LiveServer, sdk: MStarClient) -> None:
    body = httpx.get(f"{live.url}/v1/audio/voices", timeout=10).json()
    assert body == {"voices": [{"voice_id": v, "name": v, "model": MODEL, "language": None, "source": "bundled"}
                               for v in VOICES]}
    assert sdk.voices() == VOICES


# ----------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"input": ""}, "input", "at least 1 character"),
        ({"input": "  \n "}, "input", "whitespace"),
        ({"input": "x" * 4097}, "input", "at most 4096 characters"),
        ({"voice": "alloy"}, "voice", "unknown voice 'alloy'; use one of tara, leo"),
        ({"response_format": "ogg"}, "response_format", "'ogg' is not a known audio format"),
        ({"response_format": "opus"}, "response_format", "'opus' is not supported"),
        ({"response_format": "aac"}, "response_format", "'aac' is not supported"),
        ({"speed": 2.0}, "speed", "2 is not supported by this model"),
        ({"speed": 0.1}, "speed", "greater than or equal to 0.25"),
        ({"stream_format": "ndjson"}, "stream_format", "'ndjson' is not supported; use 'audio' or 'sse'"),
        ({"instructions": "whisper"}, "instructions", "not supported"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"ref_audio": "UklGRg=="}, "ref_audio", "does not support voice cloning"),
        ({"ref_text": "hello"}, "ref_text", "send it with ref_audio"),
        ({"sentence_chunking": "maybe"}, "sentence_chunking", "valid boolean"),
    ],
)
def test_invalid_requests(live: LiveServer, body: dict, param: str, needle: str) -> None:
    message = _error(_speech(live, model=MODEL, **{"input": "hi", **body}), 400, param)
    assert needle in message


def test_a_clip_for_a_model_that_does_not_clone_never_reaches_it(
        oai: openai.OpenAI, speaker: FakeSpeaker, live: LiveServer) -> None:
    before = len(speaker.speech_specs)
    with pytest.raises(openai.BadRequestError) as err:
        oai.audio.speech.create(model=MODEL, voice="tara", input="hi", extra_body={"ref_audio": "UklGRg=="})
    assert err.value.body["param"] == "ref_audio" and "does not support voice cloning" in err.value.message
    form = {"text": "hi", "output_modalities": "audio", "model_kwargs": json.dumps({"ref_audio": "UklGRg=="})}
    _error(httpx.post(f"{live.url}/generate", data=form, timeout=10), 400, "ref_audio")
    assert len(speaker.speech_specs) == before


def test_sentence_chunking_reaches_the_backend(oai: openai.OpenAI, speaker: FakeSpeaker) -> None:
    oai.audio.speech.create(model=MODEL, voice="tara", input="x", extra_body={"sentence_chunking": False})
    assert speaker.speech_specs[-1].sentence_chunking is False and speaker.speech_specs[-1].reference is None
    oai.audio.speech.create(model=MODEL, voice="tara", input="x")
    assert speaker.speech_specs[-1].sentence_chunking is None


def test_errors_through_the_openai_client(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.audio.speech.create(model=MODEL, voice="tara", input="hi", speed=2.0)
    assert err.value.status_code == 400 and "speed" in err.value.message
    with pytest.raises(openai.NotFoundError):
        oai.audio.speech.create(model="nope", voice="tara", input="hi")


def test_malformed_body(live: LiveServer) -> None:
    response = httpx.post(f"{live.url}/v1/audio/speech", content=b"{oops", timeout=10)
    assert _error(response, 400, "body").startswith("malformed JSON body")
    _error(_speech(live, model=MODEL), 400, "input")  # missing input


def test_backend_request_error_is_a_4xx(live: LiveServer) -> None:
    for stream in (False, True):
        response = _speech(live, model=MODEL, input="bad", stream=stream)
        assert "rejects this text" in _error(response, 422, "input")


def test_backend_failure_after_audio_started(live: LiveServer, sdk: MStarClient) -> None:
    response = _speech(live, model=MODEL, input="explode")
    assert response.status_code == 500 and "exploded" in response.json()["error"]["message"]
    body = {"model": MODEL, "input": "explode", "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/audio/speech", json=body, timeout=10) as r:
        assert r.status_code == 200
        with pytest.raises(httpx.TransportError):  # the connection is dropped, not ended
            for _ in r.iter_bytes():
                pass
    with pytest.raises(MStarError) as err:
        sdk.tts("explode", stream=True).read()
    assert err.value.status == 0


def test_disconnect_cancels_the_backend(live: LiveServer, speaker: FakeSpeaker) -> None:
    body = {"model": MODEL, "input": "forever", "stream": True, "response_format": "pcm"}
    with httpx.stream("POST", f"{live.url}/v1/audio/speech", json=body, timeout=10) as r:
        assert next(r.iter_raw())
    assert wait_until(lambda: "forever" in speaker.speech_cancelled, timeout=5)


def test_non_speaking_backend_refuses_the_speech_routes(server: LiveServer) -> None:
    response = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "hi"}, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.url}/v1/audio/voices", timeout=10).json()["error"]["param"] == "model"


# ----------------------------------------------------------------------- generate


def test_generate_audio_ndjson(live: LiveServer, sdk: MStarClient) -> None:
    form = {"text": "say hi", "output_modalities": '["audio"]', "streaming": "true"}
    response = httpx.post(f"{live.url}/generate", data=form, timeout=10)
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert len(lines) == 3 and lines[-1]["finish_reason"] == "stop" and "usage" in lines[-1]
    assert all(item["modality"] == "audio" and item["sample_rate"] == RATE for item in lines)
    pcm = b"".join(base64.b64decode(item["data"]) for item in lines)
    np.testing.assert_array_equal(np.frombuffer(pcm, "<f4"), SINE)

    events = list(sdk.generate("say hi", output_modalities=["audio"], stream=True))
    assert b"".join(e.data or b"" for e in events) == SINE.tobytes()
    assert {e.sample_rate for e in events} == {RATE}
    result = sdk.generate("say hi", output_modalities=["audio"])
    assert result.data["audio"] == SINE.tobytes() and result.sample_rate == RATE


# ---------------------------------------------------------------------------- SDK


def test_sdk_tts(sdk: MStarClient, speaker: FakeSpeaker, tmp_path: Path) -> None:
    result = sdk.tts("Hello", voice="tara", seed=3)
    assert isinstance(result, SpeechResult)
    assert (result.format, result.sample_rate) == ("wav", RATE)
    _assert_sine(result.audio)
    assert speaker.speech_specs[-1].model_kwargs == {"seed": 3}
    _assert_sine(result.to_wav(tmp_path / "a.wav").read_bytes())
    for fmt in ("pcm", "flac"):
        clip = sdk.tts("Hello", response_format=fmt)
        assert clip.format == fmt
        _assert_sine(clip.to_wav(tmp_path / f"{fmt}.wav").read_bytes())


def test_sdk_tts_stream(sdk: MStarClient, tmp_path: Path) -> None:
    with sdk.tts("Hello", voice="leo", stream=True) as stream:
        assert isinstance(stream, SpeechStream) and stream.sample_rate == RATE
        chunks = list(stream)
    assert len(chunks) >= 1 and chunks[0][:4] == b"RIFF"
    path = sdk.tts("Hello", stream=True).to_wav(tmp_path / "s.wav")
    wav = path.read_bytes()
    assert struct.unpack_from("<I", wav, 40)[0] == len(wav) - 44  # sizes fixed up
    assert wav[44:] == b"".join(chunks)[44:]
    _assert_sine(wav)
    pcm_stream = sdk.tts("Hello", response_format="pcm", stream=True)
    _assert_sine(pcm_stream.to_wav(tmp_path / "p.wav").read_bytes())
    with pytest.raises(RuntimeError, match="already consumed"):
        pcm_stream.read()


def test_sdk_tts_errors(sdk: MStarClient) -> None:
    with pytest.raises(MStarError) as err:
        sdk.tts("hi", voice="alloy")
    assert (err.value.status, err.value.param) == (400, "voice")
    with pytest.raises(MStarError) as err:
        sdk.tts("hi", stream=True, speed=0.5)
    assert (err.value.status, err.value.param) == (400, "speed")
