"""/v1/chat/completions with audio, the OpenAI way, over a fake model that hears and speaks
(``SpeakingChatBackend``): ``input_audio`` parts reach the model as the file's bytes, in
prompt order; ``modalities: ["text", "audio"]`` answers with ``message.audio`` (the whole
clip in ``audio.format``, base64, and its transcript; ``content`` null) or, streamed, with
``delta.audio`` pieces of PCM16 and transcript. Every refusal is a 4xx naming the field; a
text-only request is answered as before; a client that leaves a stream cancels the request."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from fastapi.testclient import TestClient

from mstar.server import chat_routes
from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer, SpeakingChatBackend, spoken_samples, wait_until

RATE = SpeakingChatBackend.sample_rate
PCM16_STEP = 1 / 32767  # one PCM16 step: what encoding a float sample may lose, at most half of it


def _wav(seconds: float = 0.05) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, np.linspace(-0.5, 0.5, int(16000 * seconds), dtype=np.float32), 16000, format="WAV")
    return buffer.getvalue()


WAV = _wav()
SPOKEN = {"voice": "ember", "format": "wav"}


def _said(text: str) -> np.ndarray:
    """The samples the fake model speaks for ``text``, word by word."""
    return np.concatenate([spoken_samples(word, RATE) for word in text.split()])


def _audio_part(data: bytes = WAV, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def _user(*parts: dict | str) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def backend() -> SpeakingChatBackend:
    return SpeakingChatBackend()


@pytest.fixture(scope="module")
def server(backend: SpeakingChatBackend) -> Iterator[LiveServer]:
    with LiveServer(create_app(backend)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=20)


def _refused(server: LiveServer, body: dict, status: int = 400) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=10)
    assert response.status_code == status, response.text
    return response.json()["error"]


# ------------------------------------------------------------------------- audio in


def test_input_audio_reaches_the_model_as_the_files_bytes(client: openai.OpenAI, backend: SpeakingChatBackend) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=_user("hear", _audio_part(), "this"))
    content = backend.chat_specs[-1].messages[-1]["content"]
    assert content == [{"type": "text", "text": "hear"}, {"type": "audio", "data": WAV},
                       {"type": "text", "text": "this"}]
    assert answer.choices[0].message.content == f"hear audio:{len(WAV)} this"
    assert answer.choices[0].message.audio is None
    assert backend.chat_specs[-1].output_modalities == ["text"] and backend.chat_specs[-1].audio is None


def test_a_data_uri_is_taken_too(server: LiveServer, backend: SpeakingChatBackend) -> None:
    part = _audio_part()
    part["input_audio"]["data"] = "data:audio/wav;base64," + part["input_audio"]["data"]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": _user(part)}, timeout=10)
    assert response.status_code == 200
    assert backend.chat_specs[-1].messages[-1]["content"] == [{"type": "audio", "data": WAV}]


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "input_audio", "input_audio": {"data": "%%%not base64", "format": "wav"}},
     "messages[0].content[1].input_audio.data"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "aiff"}},
     "messages[0].content[1].input_audio.format"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "messages[0].content[1].input_audio.data"),
    (_audio_part(b"\x89PNG\r\n\x1a\n" + bytes(64)), "messages[0].content[1].input_audio.data"),
])
def test_a_bad_audio_part_is_refused_naming_it(server: LiveServer, backend: SpeakingChatBackend, part: dict,
                                               param: str) -> None:
    seen = len(backend.chat_specs)
    assert _refused(server, {"messages": _user("hear", part)})["param"] == param
    assert len(backend.chat_specs) == seen


def test_an_audio_part_over_the_cap_is_a_413(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(chat_routes.MAX_CHAT_MEDIA_BYTES, "audio", len(WAV) - 1)
    error = _refused(server, {"messages": _user(_audio_part())}, 413)
    assert error["param"] == "messages[0].content[0].input_audio.data"


# ------------------------------------------------------------------------ audio out


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm16"])
def test_a_spoken_answer_comes_whole_in_its_format(client: openai.OpenAI, backend: SpeakingChatBackend,
                                                   fmt: str) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=_user("say three words"),
                                            modalities=["text", "audio"], audio={"voice": "slate", "format": fmt})
    message = answer.choices[0].message
    assert message.content is None and message.audio is not None
    assert message.audio.transcript == "say three words" and message.audio.id.startswith("audio-")
    data = base64.b64decode(message.audio.data)
    if fmt == "pcm16":
        samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767
    else:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == RATE
    np.testing.assert_allclose(samples, _said("say three words"), atol=PCM16_STEP)
    spec = backend.chat_specs[-1]
    assert spec.output_modalities == ["text", "audio"] and spec.audio == {"voice": "slate", "format": fmt}


def test_a_spoken_answer_streams_as_pcm16_and_transcript(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=_user("stream these four words"), stream=True,
                                            modalities=["text", "audio"], audio=SPOKEN)
    chunks = list(stream)
    pieces = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio is not None]
    pieces = [p if isinstance(p, dict) else p.model_dump(exclude_none=True) for p in pieces]
    assert pieces[0]["id"].startswith("audio-") and "expires_at" in pieces[0]
    assert pieces[-1] == {"expires_at": pieces[0]["expires_at"]}  # OpenAI's closing piece
    assert all("id" not in p for p in pieces[1:])
    pcm = b"".join(base64.b64decode(p["data"]) for p in pieces if "data" in p)
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767
    np.testing.assert_allclose(samples, _said("stream these four words"), atol=PCM16_STEP)
    assert "".join(p.get("transcript", "") for p in pieces) == "stream these four words"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_text_only_request_is_answered_as_before(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "plain words"}]}
    message = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "plain words"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=10) as response:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "plain words"
    assert not any("audio" in d for d in deltas)


@pytest.mark.parametrize(("extra", "param"), [
    ({"modalities": ["text", "audio"]}, "audio"),
    ({"modalities": ["audio"], "audio": SPOKEN}, "modalities"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ember", "format": "opus"}}, "audio.format"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ember", "format": "ogg"}}, "audio.format"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice"),
])
def test_a_spoken_answer_it_cannot_give_is_refused_naming_the_field(server: LiveServer, extra: dict,
                                                                    param: str) -> None:
    assert _refused(server, {"messages": _user("hello"), **extra})["param"] == param


def test_the_voices_of_a_speaking_chat_model_are_listed(server: LiveServer) -> None:
    voices = httpx.get(f"{server.url}/v1/audio/voices", timeout=10).json()["voices"]
    assert [v["voice_id"] for v in voices] == ["ember", "slate"] and voices[0]["model"] == MODEL


def test_a_model_that_neither_hears_nor_speaks_refuses_audio() -> None:
    text_only = TestClient(create_app(FakeBackend()))
    spoken = {"messages": _user("hello"), "modalities": ["text", "audio"], "audio": SPOKEN}
    assert text_only.post("/v1/chat/completions", json=spoken).json()["error"]["param"] == "modalities"
    heard = text_only.post("/v1/chat/completions", json={"messages": _user("hello", _audio_part())})
    assert heard.status_code == 400 and heard.json()["error"]["param"] == "messages[0].content[1]"
    assert text_only.get("/v1/audio/voices").json()["error"]["param"] == "model"


def test_leaving_a_spoken_stream_cancels_the_request(server: LiveServer, backend: SpeakingChatBackend) -> None:
    prompt = "forever spoken-disconnect"
    body = {"messages": _user(prompt), "stream": True, "modalities": ["text", "audio"], "audio": SPOKEN}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=10) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        next(lines)  # the role
        assert "data" in json.loads(next(lines)[6:])["choices"][0]["delta"]["audio"]
    assert wait_until(lambda: prompt in backend.cancelled)
