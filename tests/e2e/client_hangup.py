"""A client that sends a request and hangs up once the server is at work on it.

``hang_up_when(url, path, until, data=..., files=...)`` sends the multipart POST over a raw
socket, waits (polling ``until()``, e.g. a /metrics gauge above zero) until the server is
decoding it, then closes the connection without reading the answer: a disconnect at a known
point of the request's life, not after a guessed timeout."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx


def hang_up_when(url: str, path: str, until: Callable[[], bool], timeout: float = 30.0, **body) -> None:
    request = httpx.Request("POST", url + path, **body)
    payload = request.read()
    head = [f"POST {path} HTTP/1.1", f"Host: {urlsplit(url).netloc}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in request.headers.items() if k.lower() not in ("host", "connection")]
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "the server never started on the request"
            time.sleep(0.02)
    # leaving the block closes the socket: the client is gone
