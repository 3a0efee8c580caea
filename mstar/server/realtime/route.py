"""The WebSocket route /v1/realtime: the connection's checks, then a reader and a writer.

The API key (a bearer header, or in a browser OpenAI's ``openai-insecure-api-key.`` subprotocol)
and the model are checked once the socket is accepted, so that a refused client
reads why (an ``error`` event naming ``model`` or the key) before the close, whose reason
says it again. After that the reader hands each frame to the session and a writer task
sends the session's events in order; when the client goes, the session's work is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from mstar.server.backend import RespondingBackend
from mstar.server.errors import APIError
from mstar.server.realtime.events import error_event
from mstar.server.realtime.session import RealtimeSession
from mstar.server.realtime.vad import VadHub
from mstar.server.served import resolve_model

__all__ = ["realtime_route"]

log = logging.getLogger(__name__)

_POLICY_VIOLATION = 1008  # the WebSocket close code for a refused client
_MAX_REASON = 120  # a close reason is at most 123 bytes


_KEY_PROTOCOL = "openai-insecure-api-key."  # a browser's key, as a subprotocol (it cannot set headers)


def _offered(websocket: WebSocket) -> list[str]:
    """The subprotocols the client offered (``Sec-WebSocket-Protocol``)."""
    header = websocket.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def _check_key(websocket: WebSocket, api_key: str | None) -> None:
    """``Authorization: Bearer KEY``, or the subprotocol ``openai-insecure-api-key.KEY`` as
    OpenAI's browser clients send it."""
    if api_key is None:
        return
    scheme, _, token = websocket.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = next((p[len(_KEY_PROTOCOL):] for p in _offered(websocket) if p.startswith(_KEY_PROTOCOL)), "")
    if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", None,
                       "invalid_api_key")


async def _refuse(websocket: WebSocket, exc: APIError) -> None:
    kind = "authentication_error" if exc.status == 401 else "invalid_request_error"
    await websocket.send_text(json.dumps(error_event(exc.message, exc.param, exc.code, kind=kind)))
    reason = exc.message.encode()[:_MAX_REASON].decode(errors="ignore")
    await websocket.close(code=_POLICY_VIOLATION, reason=reason)


async def _write(websocket: WebSocket, queue: asyncio.Queue[dict[str, Any]]) -> None:
    while True:
        event = await queue.get()
        await websocket.send_text(json.dumps(event))


def realtime_route(backend: RespondingBackend, api_key: str | None = None,
                   vad: VadHub | None = None) -> Callable[[WebSocket], Awaitable[None]]:
    """The /v1/realtime endpoint over ``backend``; its sessions share one ``vad``."""
    hub = vad or VadHub()

    async def realtime(websocket: WebSocket) -> None:
        """The OpenAI Realtime API (GA events) over a WebSocket; ``?model=`` picks the model."""
        # a browser fails the handshake unless one protocol it offered is chosen: "realtime"
        await websocket.accept(subprotocol="realtime" if "realtime" in _offered(websocket) else None)
        try:
            _check_key(websocket, api_key)
            model = resolve_model(websocket, websocket.query_params.get("model"), "realtime")
        except APIError as exc:
            await _refuse(websocket, exc)
            return
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        writer = asyncio.get_running_loop().create_task(_write(websocket, queue))
        session = RealtimeSession(backend, queue.put_nowait, hub, model)
        try:
            await session.start()
            while not writer.done():
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await session.handle(message.get("text") or message.get("bytes") or b"")
        except WebSocketDisconnect:
            pass
        finally:
            await session.close()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    return realtime
