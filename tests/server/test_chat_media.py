"""/v1/chat/completions with OpenAI content parts over fake backends: ``image_url`` and
``video_url`` parts resolved by the route (data URIs and base64 decoded, remote URLs refused
unless MSTAR_ALLOW_REMOTE=1 and public, server paths never), all fetched at once before the
backend sees the request, and handed to a model that reads media as ``{"type": "image" |
"video", "data": bytes}`` parts; a text-only model gets one string per message and refuses
media parts; ``enable_thinking`` and ``repetition_penalty`` reach the ChatSpec. Every refusal
is a 4xx naming the field (``messages[i].content[j]...``)."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from mstar.contract import ChatSpec, OutputEvent
from mstar.media.fetch import MediaError
from mstar.model.llama.model import LlamaChat
from mstar.model.qwen3_5.model import Qwen3_5Chat
from mstar.server import bodies as bodies_module
from mstar.server import chat_routes
from mstar.server.app import create_app
from mstar.server.chat_routes import input_modalities
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer


def _png(colour: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _gif() -> bytes:
    frames = [Image.new("RGB", (8, 8), (i * 60, 0, 0)) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buffer.getvalue()


PNG, GIF = _png(), _gif()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image(url: str, **extra: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


class MediaBackend(FakeBackend):
    """Reads text, images and videos: answers with one word per part of the last message
    (``text:<words>``, ``image:<bytes>``, ``video:<bytes>``)."""

    input_modalities = frozenset({"text", "image", "video"})

    async def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        self.chat_specs.append(spec)
        content = spec.messages[-1]["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        words = [f"text:{p['text'].replace(' ', '_')}" if p["type"] == "text" else f"{p['type']}:{len(p['data'])}"
                 for p in parts]
        async for event in self._stream(" ".join(words), len(words), spec.max_tokens):
            yield event


class ImageOnlyBackend(MediaBackend):
    input_modalities = frozenset({"text", "image"})


@pytest.fixture()
def media_backend() -> MediaBackend:
    return MediaBackend()


@pytest.fixture()
def client(media_backend: MediaBackend) -> TestClient:
    return TestClient(create_app(media_backend))


def chat(client: TestClient, *content: dict | str, **body: object) -> httpx.Response:
    messages = [{"role": "user", "content": content[0] if len(content) == 1 and isinstance(content[0], str)
                 else list(content)}]
    return client.post("/v1/chat/completions", json={"messages": messages, **body})


def refused(response: httpx.Response, param: str, status: int = 400) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    return error["message"]


# ----------------------------------------------------------------------- accepted


def test_parts_reach_the_model_in_order_with_their_bytes(client: TestClient, media_backend: MediaBackend) -> None:
    bare = base64.b64encode(_png((0, 0, 255))).decode()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [text("what is"), image(data_uri(PNG), detail="low"), text("then"),
                                     video(data_uri(GIF, "image/gif")), image(bare)]},
    ]
    response = client.post("/v1/chat/completions", json={
        "messages": messages, "enable_thinking": False, "repetition_penalty": 1.3, "max_tokens": 8})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == (
        f"text:what_is image:{len(PNG)} text:then video:{len(GIF)} image:{len(base64.b64decode(bare))}")
    spec = media_backend.chat_specs[-1]
    assert spec.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image", "data": PNG},
                                     {"type": "text", "text": "then"}, {"type": "video", "data": GIF},
                                     {"type": "image", "data": base64.b64decode(bare)}]},
    ]
    assert spec.enable_thinking is False and spec.sampling.repetition_penalty == 1.3 and spec.max_tokens == 8


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, None),
    ({"enable_thinking": True}, True),
    ({"chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "low"}}, False),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, True),
])
def test_enable_thinking(client: TestClient, media_backend: MediaBackend, extra: dict, expected: bool | None) -> None:
    assert chat(client, "hi", **extra).status_code == 200
    assert media_backend.chat_specs[-1].enable_thinking is expected


def test_openai_client_sends_parts_and_extra_fields(media_backend: MediaBackend) -> None:
    with LiveServer(create_app(media_backend, served_model_names=[MODEL])) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=10)
        result = client.chat.completions.create(
            model=MODEL, max_tokens=16, extra_body={"enable_thinking": False, "repetition_penalty": 1.1},
            messages=[{"role": "user", "content": [{"type": "text", "text": "look"},
                                                   {"type": "image_url", "image_url": {"url": data_uri(PNG)}}]}])
        assert result.choices[0].message.content == f"text:look image:{len(PNG)}"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}]}])
        assert info.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]
    spec = media_backend.chat_specs[-1]
    assert spec.enable_thinking is False and spec.sampling.repetition_penalty == 1.1


def test_text_only_model_gets_strings_and_refuses_media() -> None:
    backend = FakeBackend()
    client = TestClient(create_app(backend))
    response = chat(client, text("one"), text("two"))
    assert response.status_code == 200 and backend.chat_specs[-1].messages[0]["content"] == "one\ntwo"
    message = refused(chat(client, text("see"), image(data_uri(PNG))), "messages[0].content[1]")
    assert f"model {MODEL!r} does not take images" in message
    refused(chat(client, video("https://example.com/v.gif")), "messages[0].content[0]")
    assert len(backend.chat_specs) == 1


def test_image_only_model_refuses_videos() -> None:
    backend = ImageOnlyBackend()
    client = TestClient(create_app(backend))
    assert chat(client, image(data_uri(PNG))).status_code == 200
    assert "does not take videos" in refused(chat(client, image(data_uri(PNG)), video(data_uri(GIF))),
                                             "messages[0].content[1]")


def test_capability_comes_from_the_model_spec() -> None:
    class RuntimeLike:  # the runtime's backend: no input_modalities of its own, a model spec
        def __init__(self, spec: type) -> None:
            self.spec = spec

    assert input_modalities(RuntimeLike(Qwen3_5Chat)) == {"text", "image", "video"}
    assert input_modalities(RuntimeLike(LlamaChat)) == {"text"}
    assert input_modalities(FakeBackend()) == {"text"}  # nothing declared: text only


# ----------------------------------------------------------------------- refused


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "file", "file": {"file_data": "x"}}, "messages[0].content[1].type"),
    ({"text": "no type"}, "messages[0].content[1].type"),
    ({"type": "image_url"}, "messages[0].content[1].image_url"),
    ({"type": "video_url", "video_url": {}}, "messages[0].content[1].video_url.url"),
    ({"type": "image_url", "image_url": {"url": ""}}, "messages[0].content[1].image_url.url"),
    (image(data_uri(PNG), detail="ultra"), "messages[0].content[1].image_url.detail"),
    ({"type": "text", "text": 5}, "messages[0].content[1].text"),
    ("just a string", "messages[0].content[1]"),
])
def test_malformed_parts_name_the_field(client: TestClient, media_backend: MediaBackend, part: object,
                                        param: str) -> None:
    refused(chat(client, text("x"), part), param)  # type: ignore[arg-type]
    assert not media_backend.chat_specs


@pytest.mark.parametrize(("url", "rule"), [
    ("data:image/png;base64,%%%", "neither a data URI"),
    ("data:image/png;base64,abcde", "invalid base64"),
    ("data:image/png;base64", "needs a comma"),
    ("data:image/png;base64,", "holds no bytes"),
    ("/etc/passwd", "paths on the server"),
    ("file:///etc/passwd", "file://"),
    ("ftp://example.com/a.png", "scheme"),
])
def test_unusable_references_are_refused(client: TestClient, media_backend: MediaBackend, url: str,
                                         rule: str) -> None:
    assert rule in refused(chat(client, text("x"), image(url)), "messages[0].content[1].image_url.url")
    assert not media_backend.chat_specs


class _Counter(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def loopback_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    server.shutdown()
    server.server_close()


def test_remote_url_refused_by_default(client: TestClient, media_backend: MediaBackend, loopback_url: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MSTAR_ALLOW_REMOTE", raising=False)
    for url in ("https://example.com/cat.png", loopback_url):
        message = refused(chat(client, text("x"), video(url)), "messages[0].content[1].video_url.url")
        assert "MSTAR_ALLOW_REMOTE=1" in message
    assert _Counter.hits == 0 and not media_backend.chat_specs


def test_private_address_refused_with_remote_on(client: TestClient, media_backend: MediaBackend,
                                                loopback_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTAR_ALLOW_REMOTE", "1")
    for url in (loopback_url, loopback_url.replace("127.0.0.1", "localhost")):
        assert "loopback" in refused(chat(client, image(url)), "messages[0].content[0].image_url.url")
    assert _Counter.hits == 0 and not media_backend.chat_specs


def test_too_many_media(client: TestClient, media_backend: MediaBackend) -> None:
    cap = chat_routes.MAX_CHAT_MEDIA
    parts = [image(data_uri(PNG))] * (cap + 1)
    message = refused(chat(client, text("x"), *parts), f"messages[0].content[{cap + 1}]")
    assert f"at most {cap} images, videos and audio clips" in message
    assert chat(client, *parts[:cap]).status_code == 200


def test_each_part_and_the_body_are_capped(client: TestClient, media_backend: MediaBackend,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(chat_routes.MAX_CHAT_MEDIA_BYTES, "image", len(PNG) - 1)
    refused(chat(client, image(data_uri(PNG))), "messages[0].content[0].image_url.url", 413)
    assert chat(client, video(data_uri(PNG))).status_code == 200  # videos have their own cap
    monkeypatch.setattr(chat_routes, "MAX_CHAT_BODY_BYTES", 1000)
    refused(chat(client, text("x" * 1000)), "body", 413)
    assert len(media_backend.chat_specs) == 1


# ------------------------------------------------------------------ fetched at once


def test_media_are_fetched_concurrently_and_a_failure_cancels_the_rest(
        media_backend: MediaBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    running, peak, cancelled = 0, 0, []

    async def slow_fetch(ref: str, *, max_bytes: int, field: str, timeout_s: float = 10) -> bytes:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            if ref == "fail":
                await asyncio.sleep(0.05)
                raise MediaError(field, "the fake fetch refuses this one")
            await asyncio.sleep(0.3 if ref == "ok" else 30)
            return ref.encode()
        except asyncio.CancelledError:
            cancelled.append(field)
            raise
        finally:
            running -= 1

    monkeypatch.setattr(bodies_module, "fetch_media", slow_fetch)
    client = TestClient(create_app(media_backend))
    assert chat(client, *[image("ok")] * 4).status_code == 200
    assert peak == 4  # all four 0.3 s fetches in flight at once (a wall-clock bound flaked under load)
    assert media_backend.chat_specs[-1].messages[0]["content"] == [{"type": "image", "data": b"ok"}] * 4

    started = time.monotonic()
    refused(chat(client, image("slow"), video("fail"), image("slow")), "messages[0].content[1].video_url.url")
    assert time.monotonic() - started < 5.0
    assert sorted(cancelled) == ["messages[0].content[0].image_url.url", "messages[0].content[2].image_url.url"]
    assert len(media_backend.chat_specs) == 1
