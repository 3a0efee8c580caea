"""The Python SDK (MStarClient) against a live server over the fake backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mstar import MStarClient as LazyClient
from mstar.client import ChatEvent, MStarClient, MStarError
from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer, wait_until


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[MStarClient]:
    with MStarClient(server.url, timeout=10) as sdk:
        yield sdk


def test_lazy_export() -> None:
    assert LazyClient is MStarClient


def test_health_and_models(client: MStarClient) -> None:
    assert client.health() is True
    assert client.models() == [MODEL, "alias"]
    assert MStarClient("http://127.0.0.1:9", timeout=1).health() is False


def test_chat(client: MStarClient, backend: FakeBackend) -> None:
    result = client.chat("hello sdk world", temperature=0, top_k=5, seed=3, stop="x", min_p=0.2)
    assert result.text == "hello sdk world" and result.finish_reason == "stop"
    assert result.usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert result.raw["object"] == "chat.completion"
    spec = backend.chat_specs[-1]
    assert (spec.sampling.temperature, spec.sampling.top_k, spec.sampling.seed) == (0, 5, 3)
    assert spec.sampling.min_p == 0.2 and spec.stop == ["x"]


def test_chat_messages_and_max_tokens(client: MStarClient) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "a b c d"}]
    result = client.chat(messages, max_tokens=2, model="alias")
    assert result.text == "a b" and result.finish_reason == "length"
    assert result.raw["model"] == "alias"


def test_chat_stream(client: MStarClient) -> None:
    events = list(client.chat("one two three", stream=True))
    assert all(isinstance(e, ChatEvent) for e in events)
    assert "".join(e.text for e in events) == "one two three"
    assert [e.finish_reason for e in events if e.finish_reason] == ["stop"]
    assert events[-1].usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_stream_closed_early_cancels(client: MStarClient, backend: FakeBackend) -> None:
    prompt = "forever sdk-close"
    events = client.chat(prompt, stream=True)
    next(events)
    next(events)
    events.close()
    assert wait_until(lambda: prompt in backend.cancelled)


def test_complete(client: MStarClient, backend: FakeBackend) -> None:
    result = client.complete("once upon a", temperature=0, stop="x", echo=True, ignore_eos=True)
    assert result.text == "once upon aonce upon a" and result.finish_reason == "stop"
    assert result.raw["object"] == "text_completion" and result.usage["completion_tokens"] == 3
    spec = backend.completion_specs[-1]
    assert (spec.prompt, spec.stop, spec.echo, spec.ignore_eos, spec.max_tokens) == ("once upon a", ["x"], True,
                                                                                      True, 16)
    assert client.complete((4, 2), max_tokens=1).text == "<4>"
    events = list(client.complete("p q r", stream=True))
    assert all(isinstance(e, ChatEvent) for e in events)
    assert "".join(e.text for e in events) == "p q r"
    assert [e.finish_reason for e in events if e.finish_reason] == ["stop"]
    assert events[-1].usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    with pytest.raises(MStarError) as info:
        client.complete("x", logprobs=1)
    assert info.value.status == 400 and info.value.param == "logprobs"


def test_errors(client: MStarClient) -> None:
    with pytest.raises(MStarError) as info:
        client.chat("x", temperature=3)
    assert info.value.status == 400 and info.value.param == "temperature"
    assert "less than or equal to 2" in info.value.message
    with pytest.raises(MStarError) as info:
        client.chat("x", model="nope")
    assert info.value.status == 404 and info.value.param == "model"
    with pytest.raises(MStarError) as info:
        client.chat("please reject", stream=True)  # raised at the call: streams open eagerly
    assert info.value.status == 422
    events = client.chat("a b explode c", stream=True)
    with pytest.raises(MStarError, match="exploded") as info:
        list(events)
    assert info.value.status == 500
    assert client.chat("still fine").text == "still fine"


def test_generate(client: MStarClient, backend: FakeBackend, tmp_path: Path) -> None:
    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG1234")
    result = client.generate(
        "look", files=[image, ("clip.wav", b"abc")], output_modalities=("text", "audio"),
        model_kwargs={"voice": "v"},
    )
    assert result.text == "look [cat.png:8] [clip.wav:3]" and result.finish_reason == "stop"
    assert result.data == {"audio": b"RIFF-fake-audio"}
    assert result.usage["completion_tokens"] == 3 and result.request_id.startswith("gen-")
    spec = backend.generate_specs[-1]
    assert spec.files == [("cat.png", b"\x89PNG1234"), ("clip.wav", b"abc")]
    assert spec.model_kwargs == {"voice": "v"} and spec.output_modalities == ["text", "audio"]
    assert client.generate("plain text").text == "plain text"


def test_generate_stream(client: MStarClient) -> None:
    events = list(client.generate("a b c", files=[("f.bin", b"xy")], stream=True))
    assert "".join(e.text for e in events) == "a b c [f.bin:2]"
    assert events[-1].finish_reason == "stop" and events[-1].usage is not None
    assert len({e.request_id for e in events}) == 1
    with pytest.raises(MStarError) as info:
        client.generate("x", model_kwargs=None, output_modalities=())
    assert info.value.param == "output_modalities"


def test_api_key() -> None:
    with LiveServer(create_app(FakeBackend(), api_key="k3y")) as live:
        with pytest.raises(MStarError) as info:
            MStarClient(live.url, timeout=5).models()
        assert info.value.status == 401
        with MStarClient(live.url, timeout=5, api_key="k3y") as sdk:
            assert sdk.models() == [MODEL]
            assert sdk.chat("ok then").text == "ok then"
