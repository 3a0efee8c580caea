"""Media inputs of the HTTP routes: /generate's ``media`` references go through
mstar.media.fetch (data URI and base64 always; URLs only with MSTAR_ALLOW_REMOTE=1 and a
public address; paths never), and multipart uploads are capped in bytes before anything
decodes them, whether the body declares its length or streams it."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi.testclient import TestClient

from mstar.server import generate_routes as generate_module
from mstar.server.app import create_app
from tests.support.fake_backend import FakeBackend, LiveServer

CLIP = b"RIFF\x24\x00\x00\x00WAVEfmt "


class _Counter(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"data")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def loopback_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/clip.wav"
    server.shutdown()
    server.server_close()


@pytest.fixture()
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture()
def client(backend: FakeBackend) -> TestClient:
    return TestClient(create_app(backend))


def _error(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return error["message"]


def test_generate_takes_media_as_data_uri_and_base64(client: TestClient, backend: FakeBackend) -> None:
    encoded = base64.b64encode(CLIP).decode()
    response = client.post("/generate", data={"text": "hear", "media": [f"data:audio/wav;base64,{encoded}", encoded]},
                           files=[("files", ("up.wav", b"abc", "audio/wav"))])
    assert response.status_code == 200, response.text
    assert backend.generate_specs[-1].files == [("up.wav", b"abc"), ("media0", CLIP), ("media1", CLIP)]


def test_generate_refuses_a_remote_url_by_default(client: TestClient, backend: FakeBackend,
                                                  monkeypatch: pytest.MonkeyPatch, loopback_url: str) -> None:
    monkeypatch.delenv("MSTAR_ALLOW_REMOTE", raising=False)
    message = _error(client.post("/generate", data={"text": "x", "media": "https://example.com/a.wav"}), 400, "media.0")
    assert "MSTAR_ALLOW_REMOTE=1" in message
    assert not backend.generate_specs


def test_generate_refuses_a_loopback_url_with_remote_on(client: TestClient, backend: FakeBackend,
                                                        monkeypatch: pytest.MonkeyPatch, loopback_url: str) -> None:
    monkeypatch.setenv("MSTAR_ALLOW_REMOTE", "1")
    hits = _Counter.hits
    for url in (loopback_url, loopback_url.replace("127.0.0.1", "localhost")):
        message = _error(client.post("/generate", data={"text": "x", "media": url}), 400, "media.0")
        assert "loopback" in message
    assert _Counter.hits == hits and not backend.generate_specs


@pytest.mark.parametrize("ref", ["/etc/passwd", "file:///etc/passwd", "../weights.bin"])
def test_generate_refuses_server_paths(client: TestClient, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch,
                                       ref: str) -> None:
    monkeypatch.setenv("MSTAR_ALLOW_REMOTE", "1")
    message = _error(client.post("/generate", data={"text": "x", "media": ref}), 400, "media.0")
    assert "paths on the server" in message or "file://" in message
    assert not backend.generate_specs


def test_generate_caps_each_upload_before_the_backend_sees_it(client: TestClient, backend: FakeBackend,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate_module, "MAX_GENERATE_FILE_BYTES", 1000)
    files = [("files", ("ok.png", b"x" * 1000, "image/png")), ("files", ("big.png", b"x" * 1001, "image/png"))]
    message = _error(client.post("/generate", data={"text": "x"}, files=files), 413, "files.1")
    assert "big.png is over the limit of 1000 bytes" in message
    encoded = base64.b64encode(b"x" * 1001).decode()
    _error(client.post("/generate", data={"text": "x", "media": encoded}), 413, "media.0")
    assert not backend.generate_specs


def test_generate_refuses_a_body_over_the_cap_before_reading_it(backend: FakeBackend,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Declared (Content-Length) or streamed (chunked): refused as soon as it passes the cap."""
    monkeypatch.setattr(generate_module, "MAX_GENERATE_FILES", 1)
    monkeypatch.setattr(generate_module, "MAX_GENERATE_FILE_BYTES", 1000)
    limit = 1000 + generate_module._FORM_OVERHEAD
    body = b"x" * (limit + 1)
    headers = {"content-type": "multipart/form-data; boundary=b"}
    with LiveServer(create_app(backend)) as live:
        declared = httpx.post(f"{live.url}/generate", content=body, headers=headers, timeout=30)
        assert "the limit is" in _error(declared, 413, "files")

        def chunks() -> Iterator[bytes]:
            yield b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.bin\"\r\n\r\n"
            for _ in range(limit // 65536 + 2):
                yield b"x" * 65536

        streamed = httpx.post(f"{live.url}/generate", content=chunks(), headers=headers, timeout=30)
        assert "over the limit" in _error(streamed, 413, "files")
    assert not backend.generate_specs


def test_generate_form_fields_must_be_text(client: TestClient) -> None:
    files = [("model_kwargs", ("k.json", b"{}", "application/json"))]
    _error(client.post("/generate", data={"text": "x"}, files=files), 400, "model_kwargs")
    _error(client.post("/generate", data={"text": "x"}, files=[("media", ("m.wav", b"abc", "audio/wav"))]),
           400, "media.0")


def test_transcription_upload_streamed_past_the_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Content-Length to check up front: the byte counter stops the body as it arrives."""
    from fuzz_backend import EveryCapabilityBackend

    from mstar.server import audio_routes

    monkeypatch.setattr(audio_routes, "MAX_UPLOAD_BYTES", 1000)
    monkeypatch.setattr(audio_routes, "_FORM_OVERHEAD", 1000)
    backend = EveryCapabilityBackend()
    transcribed: list[object] = []
    monkeypatch.setattr(backend, "transcribe", lambda spec: transcribed.append(spec))

    def chunks() -> Iterator[bytes]:
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n"
        for _ in range(8):
            yield b"x" * 1024

    with LiveServer(create_app(backend)) as live:
        response = httpx.post(f"{live.url}/v1/audio/transcriptions", content=chunks(), timeout=30,
                              headers={"content-type": "multipart/form-data; boundary=b"})
    assert response.status_code == 413 and response.json()["error"]["param"] == "file", response.text
    assert not transcribed
