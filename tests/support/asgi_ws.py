"""A WebSocket client that drives an ASGI app directly, in the test's event loop: no server,
no sockets. ``stall_after``: the client reads that many messages, then stops reading, as
a real server's send blocks once a client's TCP window is full (the app's next send
waits forever; a close still gets through, so the test reads the close code)."""

from __future__ import annotations

import asyncio
import json
from typing import Any


class AsgiSocket:
    def __init__(self, app, path: str = "/generate/ws", *, stall_after: int | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None):
        self.app = app
        self.path = path
        self.stall_after = stall_after
        self.headers = headers or []
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent = 0  # messages the app sent (not counting accept and close)
        self.close_code: int | None = None
        self.close_reason = ""
        self._task: asyncio.Task | None = None
        self._accepted = asyncio.Event()

    async def __aenter__(self) -> AsgiSocket:
        scope = {"type": "websocket", "asgi": {"version": "3.0"}, "scheme": "ws", "path": self.path,
                 "raw_path": self.path.encode(), "root_path": "", "query_string": b"",
                 "headers": [(b"host", b"test"), *self.headers], "subprotocols": [], "client": ("test", 1),
                 "server": ("test", 80)}
        await self.inbox.put({"type": "websocket.connect"})
        self._task = asyncio.get_running_loop().create_task(self.app(scope, self.inbox.get, self._send))
        await asyncio.wait_for(self._accepted.wait(), 10)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.close_code is None:
            await self.inbox.put({"type": "websocket.disconnect", "code": 1000})
        assert self._task is not None
        await asyncio.wait_for(self._task, 30)

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "websocket.accept":
            self._accepted.set()
            return
        if kind == "websocket.close":
            self.close_code, self.close_reason = message.get("code", 1000), message.get("reason") or ""
            self._accepted.set()
            await self.outbox.put(message)
            return
        if self.stall_after is not None and self.sent >= self.stall_after:
            await asyncio.Event().wait()  # never returns: the client stopped reading
        self.sent += 1
        await self.outbox.put(message)

    async def send_json(self, value: dict[str, Any]) -> None:
        await self.inbox.put({"type": "websocket.receive", "text": json.dumps(value)})

    async def send_text(self, text: str) -> None:
        await self.inbox.put({"type": "websocket.receive", "text": text})

    async def send_bytes(self, data: bytes) -> None:
        await self.inbox.put({"type": "websocket.receive", "bytes": data})

    async def hang_up(self) -> None:
        await self.inbox.put({"type": "websocket.disconnect", "code": 1001})
        self.close_code = 1001

    async def receive(self, timeout: float = 30) -> dict[str, Any] | bytes | None:
        """The next message: a JSON object, bytes, or None once the app closed the socket."""
        message = await asyncio.wait_for(self.outbox.get(), timeout)
        if message["type"] == "websocket.close":
            return None
        if message.get("bytes") is not None:
            return message["bytes"]
        return json.loads(message["text"])

    async def receive_all(self, timeout: float = 60) -> list[dict[str, Any] | bytes]:
        """Every message until the app closes the socket."""
        out = []
        while (message := await self.receive(timeout)) is not None:
            out.append(message)
        return out
