"""``/generate/ws``: one WebSocket per client, a session's inputs in and its outputs out as
they are made (docs/sessions.md has the client's side).

The socket is one session. The opening message holds ``/generate``'s fields (validated by
the same pydantic body, so an error names the field); each ``append`` that follows runs as
one request of the session, the opening's fields as its defaults, the first one starting
the session (or resuming it, with ``resume_session``) and every later one resuming it.
Appends run one after another (one request in flight per session), so their outputs come
back in order; the session is pinned while the socket is open (neither evicted nor expired
between appends). ``end_input`` ends the session once the appends before it are done, then a
``done`` message and a normal close.

A model whose input is a client stream (``live_stream``: Nemotron VoiceChat) is served as a
live call instead (``_LiveCall``): the socket is one request, its appends the items of that
stream and ``end_input`` its end.

A reader task takes the client's messages; a runner task runs the appends; a writer task
sends what is queued for the client. The send queue holds at most ``SEND_QUEUE_MESSAGES``
messages: a client that stops reading fills it, and is closed with ``CLOSE_NOT_READING``,
its request in flight cancelled and its session freed (the server never buffers an
unbounded backlog for it).
"""

from __future__ import annotations

import asyncio
import binascii
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import WebSocket
from pydantic import ConfigDict, Field, ValidationError
from starlette.websockets import WebSocketDisconnect

from mstar.contract import GenerateSpec, RequestError, SessionSpec
from mstar.server.bodies import fetch_all
from mstar.server.errors import validation_error_response
from mstar.server.schemas import GenerateForm, new_id, parse_output_modalities
from mstar.server.served import default_generate_outputs

log = logging.getLogger(__name__)

SEND_QUEUE_MESSAGES = 64  # messages waiting for a client before it counts as not reading
MAX_PENDING_APPENDS = 256  # appends waiting to run; past it an append is refused (an error message)
MAX_APPEND_BYTES = 64 * 1024 * 1024  # one append's media, as /generate's per-file cap
DRAIN_S = 30.0  # after ``done``, how long the queued messages may take to leave before the client counts as not reading

CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # a bad opening message, or a missing or wrong API key
CLOSE_INTERNAL = 1011  # a request of the session failed in the server: the session is gone
CLOSE_NOT_READING = 4008  # the client let SEND_QUEUE_MESSAGES messages pile up unread
CLOSE_SESSION_BUSY = 4409  # another request holds the session (HTTP's 409)
CLOSE_SESSION_GONE = 4410  # the session to resume is unknown, ended, expired or evicted (HTTP's 410)
_MAX_REASON = 120  # a close reason is at most 123 bytes


class GenerateWsOpen(GenerateForm):
    """The opening message: ``/generate``'s fields, ``model_kwargs`` as an object (or its
    JSON string), and ``end_input`` for a one-shot request whose inputs are all here. Unlike
    the form, an unknown field is an error naming it (a misspelt ``session_id`` would
    otherwise start a session nobody can resume)."""

    model_config = ConfigDict(extra="forbid")
    model_kwargs: dict[str, Any] | str | None = None  # type: ignore[assignment]
    end_input: bool = Field(False, description="run the opening's inputs as the only request, then close")


class _Overflow(Exception):
    """The client stopped reading: its send queue is full."""


class _Client:
    """The socket's outgoing side: a bounded queue a writer task drains in order."""

    def __init__(self, websocket: WebSocket):
        self.websocket = websocket
        self.queue: asyncio.Queue[str | bytes] = asyncio.Queue(SEND_QUEUE_MESSAGES)

    def send(self, message: dict[str, Any] | bytes) -> None:
        try:
            self.queue.put_nowait(message if isinstance(message, bytes) else json.dumps(message))
        except asyncio.QueueFull:
            raise _Overflow from None

    def error(self, field: str | None, message: str, status: int) -> None:
        self.send({"type": "error", "field": field, "message": message, "status": status})

    async def write(self) -> None:
        while True:
            message = await self.queue.get()
            if isinstance(message, bytes):
                await self.websocket.send_bytes(message)
            else:
                await self.websocket.send_text(message)
            self.queue.task_done()


def _bearer_ok(websocket: WebSocket, api_key: str | None) -> bool:
    if api_key is None:
        return True
    scheme, _, token = websocket.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def _opening(raw: dict[str, Any] | None) -> GenerateWsOpen:
    if raw is None:
        raise RequestError("type", "the first message must be a JSON object of /generate's fields")
    data = dict(raw)
    data.pop("type", None)
    return GenerateWsOpen.model_validate(data)


async def _close(websocket: WebSocket, code: int, reason: str) -> None:
    try:
        await websocket.close(code=code, reason=reason.encode()[:_MAX_REASON].decode(errors="ignore"))
    except Exception:  # the client is gone already
        pass


def generate_ws_route(api_key: str | None = None) -> Callable[[WebSocket], Awaitable[None]]:
    """The /generate/ws endpoint (the backend is the app's ``state.backend``)."""

    async def generate_ws(websocket: WebSocket) -> None:
        await websocket.accept()
        if not _bearer_ok(websocket, api_key):
            await websocket.send_text(json.dumps({"type": "error", "field": None, "status": 401,
                                                  "message": "missing or invalid API key"}))
            await _close(websocket, CLOSE_POLICY, "missing or invalid API key")
            return
        try:
            first = await websocket.receive()
            if first["type"] == "websocket.disconnect":
                return
            opening = _opening(_json_object(first))
            defaults = _defaults(opening, default_generate_outputs(websocket.app.state.backend))
        except ValidationError as exc:
            detail = json.loads(validation_error_response(exc.errors()).body)["error"]
            await websocket.send_text(json.dumps({"type": "error", "field": detail["param"],
                                                  "message": detail["message"], "status": 400}))
            await _close(websocket, CLOSE_POLICY, detail["message"])
            return
        except RequestError as exc:
            await websocket.send_text(json.dumps({"type": "error", "field": exc.field, "message": exc.message,
                                                  "status": exc.status}))
            await _close(websocket, CLOSE_POLICY, f"{exc.field}: {exc.message}")
            return
        except WebSocketDisconnect:
            return
        backend = websocket.app.state.backend
        socket = _LiveCall if getattr(backend, "live_stream", None) else _Socket
        await socket(websocket, backend, opening, defaults).serve()

    return generate_ws


def _json_object(message: dict[str, Any]) -> dict[str, Any] | None:
    """A text message's JSON object (None for a binary one); a ``RequestError`` naming
    ``message`` when it is not JSON or not an object."""
    text = message.get("text")
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError("message", f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError("message", "must be a JSON object")
    return value


def _defaults(opening: GenerateWsOpen, outputs: tuple[str, ...] = ("text",)) -> dict[str, Any]:
    """What every append's request starts from: the opening's text, output modalities (left
    out: ``outputs``, the model's default) and model_kwargs, checked once here."""
    kwargs = opening.model_kwargs
    if isinstance(kwargs, str):
        from mstar.server.schemas import parse_model_kwargs

        kwargs = parse_model_kwargs(kwargs)
    session = opening.session()  # resume_session / end_session without session_id: an error naming it
    return {"text": opening.text, "output_modalities": parse_output_modalities(opening.output_modalities, outputs),
            "model_kwargs": kwargs or {}, "session": session}


class _Socket:
    """One connection after its opening message."""

    def __init__(self, websocket: WebSocket, backend, opening: GenerateWsOpen, defaults: dict[str, Any]):
        self.websocket = websocket
        self.backend = backend
        self.opening = opening
        self.defaults = defaults
        named: SessionSpec | None = defaults["session"]
        self.named = named is not None  # the client named the session: kept at end_input unless end_session
        self.session = named or SessionSpec(new_id("ws"), timeout_s=opening.session_timeout_s)
        self.client = _Client(websocket)
        self.appends: asyncio.Queue[tuple[dict[str, Any], list[bytes]] | None] = asyncio.Queue()
        self.started = self.session.resume  # whether the next append resumes the session
        self.owned = False  # one of its appends ran in the session: the socket may end it
        self.ran = 0
        self.close_code, self.close_reason = CLOSE_NORMAL, "done"
        self.kept = False

    async def serve(self) -> None:
        pin = getattr(self.backend, "pin_session", None)  # a backend without sessions keeps none
        if pin is not None:  # its session outlives the gaps between appends, whatever the store's size
            pin(self.session.session_id)
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self.client.write())
        runner = loop.create_task(self._run())
        reader = loop.create_task(self._read())
        try:
            self.client.send({"type": "session", "session_id": self.session.session_id})
            if self.opening.end_input:  # one shot: the opening's inputs are the only request
                await self.appends.put(({}, []))
                await self.appends.put(None)
            done, _ = await asyncio.wait({runner, reader}, return_when=asyncio.FIRST_COMPLETED)
            if runner in done and runner.exception() is None:
                # every message is queued: let the writer send them, unless the client stops reading
                drained = asyncio.ensure_future(self.client.queue.join())
                await asyncio.wait({drained, writer, reader}, timeout=DRAIN_S, return_when=asyncio.FIRST_COMPLETED)
                if not drained.done():
                    drained.cancel()
                    if not reader.done() and not writer.done():
                        self._not_reading()
        except _Overflow:
            self._not_reading()
        finally:
            for task in (reader, runner):
                task.cancel()
            results = await asyncio.gather(reader, runner, return_exceptions=True)
            if any(isinstance(r, _Overflow) for r in results):
                self._not_reading()
            failed = [r for r in results if isinstance(r, Exception) and not isinstance(r, _Overflow)]
            if failed:
                log.error("/generate/ws session %s failed: %r", self.session.session_id, failed[0])
                self.close_code, self.close_reason = CLOSE_INTERNAL, f"the server failed: {failed[0]}"
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            if pin is not None:
                pin(self.session.session_id, False)
                if self.owned and not self.kept:  # never end a session another client holds (a 409)
                    self.backend.end_session(self.session.session_id)
            await _close(self.websocket, self.close_code, self.close_reason)

    def _not_reading(self) -> None:
        self.close_code = CLOSE_NOT_READING
        self.close_reason = f"the client did not read: {SEND_QUEUE_MESSAGES} messages waited to be sent"
        self.kept = False
        log.info("closing /generate/ws session %s: %s", self.session.session_id, self.close_reason)

    # ---------------------------------------------------------------- reader
    async def _read(self) -> None:
        """The client's messages until it hangs up (the serve loop then cancels the runner and
        frees the session). A malformed one gets an error message naming the field, and the
        socket stays usable."""
        ended = False
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                if ended:
                    raise RequestError("type", "the input has ended (end_input came already)")
                if message.get("bytes") is not None:
                    self._queue_append({}, [message["bytes"]])
                    continue
                body = _json_object(message) or {}
                kind = body.get("type")
                if kind == "end_input":
                    ended = True
                    self.appends.put_nowait(None)
                    continue
                if kind != "append":
                    raise RequestError("type", f"must be 'append' or 'end_input', got {kind!r}")
                self._queue_append(body, await _media_of(body))
            except RequestError as exc:
                self.client.error(exc.field, exc.message, exc.status)

    def _queue_append(self, body: dict[str, Any], files: list[bytes]) -> None:
        if self.appends.qsize() >= MAX_PENDING_APPENDS:
            raise RequestError("append", f"{MAX_PENDING_APPENDS} appends are waiting already; wait for outputs")
        unknown = sorted(set(body) - {"type", "text", "model_kwargs", "media"})
        if unknown:
            raise RequestError(unknown[0], "unknown field of an append (it takes text, model_kwargs, media)")
        if "text" in body and not isinstance(body["text"], str):
            raise RequestError("text", "must be a string")
        if "model_kwargs" in body and not isinstance(body["model_kwargs"], dict):
            raise RequestError("model_kwargs", "must be a JSON object")
        self.appends.put_nowait((body, files))

    # ---------------------------------------------------------------- runner
    async def _opening_media(self) -> list[bytes] | None:
        """The opening's decoded media, or None when they are refused (the client is told and
        the socket set to close)."""
        try:
            return await _media_of({"media": self.opening.media}, "media")
        except RequestError as exc:
            self.client.error(exc.field, exc.message, exc.status)
            self.close_code, self.close_reason = CLOSE_POLICY, f"{exc.field}: {exc.message}"
            return None

    async def _run(self) -> None:
        """Each append as one request of the session, in order; then ``done``."""
        first_media = await self._opening_media()
        if first_media is None:
            return
        while True:
            queued = await self.appends.get()
            if queued is None:
                break
            body, files = queued
            if self.ran == 0:
                files = first_media + files
            if not await self._one(body, files):
                return
        if self.named and not self.session.end:
            self.kept = True
        self.client.send({"type": "done", "appends": self.ran, "session_id": self.session.session_id,
                          "session_kept": self.kept})

    async def _one(self, body: dict[str, Any], files: list[bytes]) -> bool:
        """Run one append; False when the socket must close (its session is gone)."""
        index = self.ran
        session = SessionSpec(self.session.session_id, resume=self.started, end=False,
                              timeout_s=self.session.timeout_s)
        spec = GenerateSpec(
            request_id=new_id("ws"),
            text=body.get("text", self.defaults["text"]),
            files=[(f"append{index}-{i}", data) for i, data in enumerate(files)],
            output_modalities=self.defaults["output_modalities"],
            model_kwargs=self.defaults["model_kwargs"] | body.get("model_kwargs", {}),
            stream=True,
            session=session,
        )
        finish = None
        try:
            async with aclosing(self.backend.generate(spec)) as events:
                async for event in events:
                    self.started = self.owned = True  # it was submitted: the session holds its state now
                    if event.error:
                        self.client.error(event.error_field, event.error, event.error_status or 500)
                        self.close_code, self.close_reason = CLOSE_INTERNAL, "a request of the session failed"
                        return False
                    self._output(index, event)
                    finish = event.finish_reason or finish
        except RequestError as exc:
            self.client.error(exc.field, exc.message, exc.status)
            if exc.status in (409, 410):
                self.close_code = CLOSE_SESSION_BUSY if exc.status == 409 else CLOSE_SESSION_GONE
                self.close_reason = exc.message
                return False
            return True  # refused before it ran (a bad input): the session is as it was
        self.started = self.owned = True
        self.ran += 1
        self.client.send({"type": "append_done", "append": index, "finish_reason": finish or "stop"})
        return True

    def _output(self, index: int, event) -> None:
        if event.progress is not None:
            self.client.send({"type": "progress", "append": index, "step": event.progress[0],
                              "total": event.progress[1]})
        elif event.data is not None:  # media: a header, then the bytes as one binary message
            self.client.send({"type": "output", "append": index, "modality": event.modality,
                              "bytes": len(event.data)})
            self.client.send(event.data)
        elif event.text:
            self.client.send({"type": "output", "append": index, "modality": event.modality, "text": event.text})


class _LiveCall(_Socket):
    """A model whose input is a client stream (``live_stream``: Nemotron VoiceChat's audio):
    the socket is one request. The opening's fields and media start it; each append's files
    are items of its stream, in order; ``end_input`` ends its input, and the request ends
    when its stages have consumed it. Outputs carry ``append: 0`` and their ``token_ids``;
    media (the agent's speech) is a header with its ``bytes``, then one binary message.
    An append the model refuses (a wrong rate, too many channels) gets an error naming the
    field and changes nothing; one that passes the stream's cap (``max_session_s``) gets a
    400 and ends the input."""

    async def _run(self) -> None:
        first_media = await self._opening_media()
        if first_media is None:
            return
        request_id = new_id("ws")
        spec = GenerateSpec(request_id=request_id, text=self.defaults["text"],
                            files=[(f"media{i}", data) for i, data in enumerate(first_media)],
                            output_modalities=self.defaults["output_modalities"],
                            model_kwargs=self.defaults["model_kwargs"], stream=True,
                            live_input=not self.opening.end_input)
        pump = asyncio.ensure_future(self._pump(request_id)) if not self.opening.end_input else None
        finish = None
        try:
            async with aclosing(self.backend.generate(spec)) as events:
                async for event in events:
                    if event.error:
                        self.client.error(event.error_field, event.error, event.error_status or 500)
                        self.close_code, self.close_reason = CLOSE_INTERNAL, "the call failed"
                        return
                    if event.data is not None:  # the agent's speech: a header, then the bytes
                        self.client.send({"type": "output", "append": 0, "modality": event.modality,
                                          "bytes": len(event.data)})
                        self.client.send(event.data)
                    elif event.token_ids or event.text:
                        self.client.send({"type": "output", "append": 0, "modality": event.modality,
                                          "text": event.text, "token_ids": list(event.token_ids)})
                    finish = event.finish_reason or finish
        except RequestError as exc:
            self.client.error(exc.field, exc.message, exc.status)
            self.close_code, self.close_reason = CLOSE_POLICY, f"{exc.field}: {exc.message}"
            return
        finally:
            if pump is not None:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
        self.client.send({"type": "append_done", "append": 0, "finish_reason": finish or "stop"})
        self.client.send({"type": "done", "appends": self.ran, "session_id": self.session.session_id,
                          "session_kept": False})

    async def _pump(self, request_id: str) -> None:
        """The reader's appends into the request's stream once it is submitted (the submission
        and the appends run on this event loop, so none can slip in between)."""
        while not self.backend.knows(request_id):
            await asyncio.sleep(0.005)
        var = self.backend.live_stream
        while True:
            queued = await self.appends.get()
            if queued is None:
                self.backend.end_input(request_id)
                return
            body, files = queued
            unknown = sorted(set(body) - {"type", "media"})
            try:
                if unknown:
                    raise RequestError(unknown[0], "unknown field of a live call's append (it takes media)")
                items = [await asyncio.to_thread(self.backend.append_item, data, f"media[{i}]")
                         for i, data in enumerate(files)]
            except RequestError as exc:
                self.client.error(exc.field, exc.message, exc.status)
                continue
            try:
                for item in items:
                    self.backend.append(request_id, var, item)
            except RequestError as exc:  # past the stream's cap: the call ends with what it heard
                self.client.error(exc.field, exc.message, exc.status)
                self.backend.end_input(request_id)
                return
            self.ran += 1


async def _media_of(body: dict[str, Any], field: str = "media") -> list[bytes]:
    """An append's ``media``: base64 strings or data URIs (resolved as /generate's)."""
    refs = body.get(field) or []
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise RequestError(field, "must be a list of base64 strings or data URIs")
    try:
        return await fetch_all([(ref, f"{field}.{i}", MAX_APPEND_BYTES) for i, ref in enumerate(refs)])
    except (binascii.Error, ValueError) as exc:
        raise RequestError(field, f"cannot be decoded: {exc}") from None


__all__ = ["generate_ws_route", "CLOSE_NOT_READING", "SEND_QUEUE_MESSAGES"]
