"""The Realtime API for ``MStarClient``: ``realtime()`` opens /v1/realtime.

    >>> async with client.realtime(session={"output_modalities": ["text"]}) as conn:
    ...     await conn.send({"type": "conversation.item.create", "item": {
    ...         "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
    ...     await conn.send({"type": "response.create"})
    ...     async for event in conn:
    ...         if event["type"] == "response.output_text.delta":
    ...             print(event["delta"], end="")
    ...         elif event["type"] == "response.done":
    ...             break

Events are the API's JSON objects as dicts (GA names; see docs/realtime.md). An ``error``
event the server sends mid-session is yielded like any other (the session goes on); a
connection the server refuses (bad key, a model without the ``realtime`` task) raises
``MStarError`` from ``realtime()`` itself.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import websockets
from websockets.asyncio.client import ClientConnection

from mstar.client.errors import MStarError, in_band_error

__all__ = ["RealtimeConnection", "RealtimeMixin"]


class RealtimeConnection:
    """An open Realtime session: ``send`` client events, iterate (or ``recv``) server events.
    ``session`` is the session as ``session.created`` (then ``session.updated``) described it."""

    def __init__(self, socket: ClientConnection, session: dict[str, Any]) -> None:
        self.socket = socket
        self.session = session

    async def send(self, event: Mapping[str, Any]) -> None:
        await self.socket.send(json.dumps(dict(event)))

    async def append_audio(self, pcm16: bytes) -> None:
        """Send PCM16 LE mono 24 kHz audio (``input_audio_buffer.append``)."""
        await self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()})

    async def recv(self) -> dict[str, Any]:
        """The next server event; ``websockets.ConnectionClosed`` once the socket is closed."""
        event = json.loads(await self.socket.recv())
        if event.get("type") == "session.updated":
            self.session = event["session"]
        return event

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        """Server events until the socket closes."""
        while True:
            try:
                yield await self.recv()
            except websockets.ConnectionClosed:
                return

    async def close(self) -> None:
        await self.socket.close()


class RealtimeMixin:
    """``MStarClient``'s ``realtime()``."""

    if TYPE_CHECKING:  # provided by MStarClient
        base_url: str
        _api_key: str | None

    @asynccontextmanager
    async def realtime(self, *, model: str | None = None,
                       session: Mapping[str, Any] | None = None) -> AsyncIterator[RealtimeConnection]:
        """Open /v1/realtime (``model``: the served name; default the server's first), send
        ``session`` as a ``session.update`` if given (its ``session.updated`` is read before
        this yields), and close the socket on leaving the block."""
        url = self.base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + "/v1/realtime"
        if model is not None:
            url += "?" + urlencode({"model": model})
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            socket = await websockets.connect(url, additional_headers=headers, max_size=None)
        except (OSError, websockets.InvalidHandshake) as exc:
            raise MStarError(0, f"cannot open {url}: {exc}") from exc
        try:
            connection = RealtimeConnection(socket, await self._first(socket, "session.created"))
            if session is not None:
                await connection.send({"type": "session.update", "session": dict(session)})
                connection.session = await self._first(socket, "session.updated")
            yield connection
        finally:
            await socket.close()

    @staticmethod
    async def _first(socket: ClientConnection, kind: str) -> dict[str, Any]:
        """The session of the next event, which must be ``kind``; an error raises."""
        try:
            event = json.loads(await socket.recv())
        except websockets.ConnectionClosed as exc:
            raise MStarError(0, f"the server closed the realtime socket: {exc}") from exc
        if event.get("type") == "error":
            raise in_band_error(event)
        if event.get("type") != kind:
            raise MStarError(0, f"expected {kind}, the server sent {event.get('type')!r}")
        return event["session"]
