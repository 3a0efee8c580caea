"""A backend's event stream as a route consumes it.

However a request ends (finished, failed, client gone), the backend's event iterator is
closed: that is how the backend learns to cancel a request. The first event is taken before
any response starts, so a refusal or a failure in the queue is still a plain HTTP error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mstar.contract import OutputEvent
from mstar.server.errors import BackendFailure, error_response
from mstar.server.metrics import observe_first_output
from mstar.server.schemas import Usage

log = logging.getLogger(__name__)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Events = AsyncIterator[OutputEvent]


async def next_event(events: Events) -> OutputEvent | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def close_events(events: Events) -> None:
    """Close the backend's iterator (cancelling its request), even inside a cancelled scope."""
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:  # a backend failing to clean up must not break the response
            log.exception("closing the backend's event iterator failed")


@dataclass
class Tally:
    """What a request produced so far. Token counts in events are running totals."""

    text: list[str] = field(default_factory=list)
    data: dict[str, bytearray] = field(default_factory=dict)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_tokens: int = 0  # fallback when the backend leaves completion_tokens at 0

    def add(self, event: OutputEvent) -> None:
        self.prompt_tokens = max(self.prompt_tokens, event.prompt_tokens)
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        self.counted_tokens += len(event.token_ids)
        if event.text:
            self.text.append(event.text)
        if event.data is not None:
            self.data.setdefault(event.modality, bytearray()).extend(event.data)
        self.finish_reason = event.finish_reason or self.finish_reason

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens or self.counted_tokens)


async def start_events(
    open_events: Callable[[], Events], request: Request | None = None
) -> tuple[OutputEvent | None, Events]:
    """Open the backend's stream and take its first event, so that a RequestError raised
    on the first advance, or a first event that is an error (a timeout in the queue, a
    dead worker), still becomes a plain HTTP error, before any stream starts."""
    events = open_events()
    try:
        first = await next_event(events)
        if first is not None and (first.error or first.finish_reason == "error"):
            raise BackendFailure.of(first)
    except BaseException:
        await close_events(events)
        raise
    if request is not None and first is not None:
        observe_first_output(request)
    return first, events


async def walk_events(first: OutputEvent | None, events: Events, tally: Tally) -> Events:
    """The backend's events from ``first`` on, added to ``tally``. Stops after the event
    with a finish_reason, raises BackendFailure on an error event, always closes ``events``."""
    try:
        event = first
        while event is not None:
            if event.error or event.finish_reason == "error":
                raise BackendFailure.of(event)
            tally.add(event)
            yield event
            if event.finish_reason:
                return
            event = await next_event(events)
    finally:
        await close_events(events)


async def collect_events(first: OutputEvent | None, events: Events) -> Tally:
    tally = Tally()
    async with aclosing(walk_events(first, events, tally)) as walk:
        async for _ in walk:
            pass
    tally.finish_reason = tally.finish_reason or "stop"
    return tally


async def unless_disconnected(
    request: Request, work: Callable[[], Awaitable[Response]]
) -> Response:
    """Run ``work``, cancelling it if the client disconnects first (the request body must
    have been read). Cancelling closes the backend's iterator (``_walk``'s finally)."""
    result = error_response(499, "client closed the request")

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client disconnected; cancelling the request")
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        result = await work()
        tg.cancel_scope.cancel()
    return result


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator when it is done, whatever
    the ASGI server's disconnect handling (so the generator's finally runs now, not at GC)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def sse(payload: dict | str) -> str:
    """One server-sent event carrying ``payload`` (a dict as JSON; a string, ``[DONE]``, as is)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def text_chunks(render: Callable[[str], str]) -> Callable[[str], str]:
    """A text delta's SSE event from a template: ``render(text)`` makes the whole event of one
    delta; the one returned fills a copy made once with the text's JSON string, so a token
    costs one ``json.dumps`` of its text instead of building and dumping a pydantic chunk. The
    bytes are the same."""
    marker = "\x00text\x00"
    before, after = render(marker).split(json.dumps(marker), 1)
    return lambda text: before + json.dumps(text) + after


def stream_response(body: AsyncIterator[str], media_type: str) -> Response:
    return ClosingStreamingResponse(body, media_type=media_type, headers=STREAM_HEADERS)
