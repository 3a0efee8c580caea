"""mstar.media.fetch: which media references the server resolves, and how it fetches URLs.

A real HTTP server on 127.0.0.1 stands in for remote hosts. With remote fetch on it must
still be refused (loopback); the tests of the download itself (size cap while streaming,
redirects re-checked, time limit) declare that one address public through
``is_public_address`` and nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mstar.media import fetch as fetch_module
from mstar.media.fetch import MediaError, fetch_media, is_public_address

PAYLOAD = bytes(range(256)) * 4
LOOPBACK = ipaddress.ip_address("127.0.0.1")


class _Handler(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        type(self).hits.append(self.path)
        if self.path == "/payload":
            self._send(200, PAYLOAD, {"Content-Length": str(len(PAYLOAD))})
        elif self.path == "/chunked":  # no Content-Length: the cap must hold while streaming
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"400\r\n" + b"x" * 1024 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/to-private":
            self._send(302, b"", {"Location": "http://10.1.2.3/secret", "Content-Length": "0"})
        elif self.path == "/to-payload":
            self._send(302, b"", {"Location": "/payload", "Content-Length": "0"})
        elif self.path == "/loop":
            self._send(302, b"", {"Location": "/loop", "Content-Length": "0"})
        elif self.path == "/slow":
            time.sleep(3)
            self._send(200, b"late", {"Content-Length": "4"})
        else:
            self._send(404, b"", {"Content-Length": "0"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def local_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture()
def remote_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTAR_ALLOW_REMOTE", "1")


@pytest.fixture()
def loopback_counts_as_public(monkeypatch: pytest.MonkeyPatch, remote_on: None) -> None:
    monkeypatch.setattr(fetch_module, "is_public_address", lambda ip: ip == LOOPBACK)


def _fetch(ref: str, max_bytes: int = 1 << 20, **kwargs) -> bytes:
    return asyncio.run(fetch_media(ref, max_bytes=max_bytes, field="media.0", **kwargs))


def _refused(ref: str, max_bytes: int = 1 << 20, **kwargs) -> MediaError:
    with pytest.raises(MediaError) as info:
        _fetch(ref, max_bytes, **kwargs)
    assert info.value.field == "media.0" and 400 <= info.value.status < 500
    return info.value


# ------------------------------------------------------------------------ inline


def test_data_uris_and_base64_resolve() -> None:
    encoded = base64.b64encode(PAYLOAD).decode()
    assert _fetch(f"data:image/png;base64,{encoded}") == PAYLOAD
    assert _fetch(encoded) == PAYLOAD
    assert _fetch(base64.urlsafe_b64encode(PAYLOAD).decode().rstrip("=")) == PAYLOAD
    assert _fetch("data:text/plain,hello%20there") == b"hello there"
    assert "invalid base64" in _refused("data:image/png;base64,abcde").message
    assert "neither a data URI" in _refused("not base64!").message


def test_oversized_inline_media_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args, **kwargs):
        raise AssertionError("oversized media was decoded")

    encoded = base64.b64encode(PAYLOAD).decode()
    monkeypatch.setattr(fetch_module.base64, "b64decode", no_decoding)
    for ref in (encoded, f"data:audio/wav;base64,{encoded}"):
        error = _refused(ref, max_bytes=100)
        assert error.status == 413 and "limit of 100 bytes" in error.message


# ------------------------------------------------------------------ refused refs


def test_remote_url_is_refused_by_default(monkeypatch: pytest.MonkeyPatch, local_url: str) -> None:
    monkeypatch.delenv("MSTAR_ALLOW_REMOTE", raising=False)
    hits = len(_Handler.hits)
    for url in ("https://example.com/cat.png", f"{local_url}/payload"):
        error = _refused(url)
        assert "MSTAR_ALLOW_REMOTE=1" in error.message
    monkeypatch.setenv("MSTAR_ALLOW_REMOTE", "yes")  # only "1" turns it on
    _refused("https://example.com/cat.png")
    assert len(_Handler.hits) == hits


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "10.0.0.7", "192.168.1.1", "169.254.169.254",
                                  "[::1]", "[::ffff:127.0.0.1]", "224.0.0.1", "0.0.0.0", "240.0.0.1"])
def test_private_addresses_are_refused_with_remote_on(remote_on: None, local_url: str, host: str) -> None:
    port = local_url.rsplit(":", 1)[1]
    hits = len(_Handler.hits)
    error = _refused(f"http://{host}:{port}/payload")
    assert "private, loopback, link-local" in error.message
    assert len(_Handler.hits) == hits  # refused before connecting


@pytest.mark.parametrize("ref", ["/etc/passwd", "./model.bin", "../secrets", "~/.ssh/id_rsa", "C:\\windows\\win.ini",
                                 "file:///etc/passwd", "FILE://localhost/etc/passwd"])
@pytest.mark.parametrize("remote", ["0", "1"])
def test_server_paths_are_always_refused(monkeypatch: pytest.MonkeyPatch, ref: str, remote: str) -> None:
    monkeypatch.setenv("MSTAR_ALLOW_REMOTE", remote)
    error = _refused(ref)
    assert "paths on the server" in error.message or "file:// URLs are refused" in error.message


@pytest.mark.parametrize("ref", ["ftp://example.com/a.png", "gopher://example.com/", "s3://bucket/key"])
def test_other_schemes_are_refused(remote_on: None, ref: str) -> None:
    assert "is not allowed" in _refused(ref).message


def test_public_address_rule() -> None:
    assert is_public_address(ipaddress.ip_address("93.184.216.34"))
    assert is_public_address(ipaddress.ip_address("2606:4700::1111"))
    for ip in ("127.0.0.1", "10.1.1.1", "172.16.0.1", "100.64.0.1", "169.254.1.1", "224.0.0.1", "255.255.255.255",
               "::1", "fe80::1", "fc00::1", "::ffff:10.0.0.1", "::"):
        assert not is_public_address(ipaddress.ip_address(ip)), ip


# ------------------------------------------------------------------- downloading


def test_a_public_url_is_fetched(loopback_counts_as_public: None, local_url: str) -> None:
    assert _fetch(f"{local_url}/payload") == PAYLOAD
    assert _fetch(f"{local_url}/to-payload") == PAYLOAD  # a redirect to an allowed address
    assert "HTTP 404" in _refused(f"{local_url}/missing").message


def test_size_cap_holds_while_streaming(loopback_counts_as_public: None, local_url: str) -> None:
    assert _refused(f"{local_url}/payload", max_bytes=100).status == 413  # by its Content-Length
    error = _refused(f"{local_url}/chunked", max_bytes=10_000)  # no length: counted as it arrives
    assert error.status == 413 and "limit of 10000 bytes" in error.message


def test_redirects_are_checked_like_the_first_url(loopback_counts_as_public: None, local_url: str) -> None:
    error = _refused(f"{local_url}/to-private")
    assert "10.1.2.3" in error.message and "private" in error.message
    assert "redirected more than" in _refused(f"{local_url}/loop").message


def test_fetching_has_a_time_limit(loopback_counts_as_public: None, local_url: str) -> None:
    started = time.monotonic()
    error = _refused(f"{local_url}/slow", timeout_s=0.5)
    assert "longer than 0.5 s" in error.message and time.monotonic() - started < 2.5
