"""Events from the runtime's threads to the asyncio code that streams them to clients.

The emit thread produces one event per request per decode step: 64 at a time with 64
streams. Handing each over with its own ``call_soon_threadsafe`` wrote a byte to the event
loop's self-pipe per token and woke the loop per token, and every consumer took its events
one ``await queue.get()`` at a time. Here an event loop has one ``Mailbox``: the events
posted while the loop is busy wait in one list, and one wake-up hands them all to their
sinks. A sink's consumer takes every event waiting for it at once (``AsyncSink.take``), so a
request whose client fell behind catches up in one step instead of one per token.

Measured on a CPU proxy (a tiny Llama behind ``mstar serve``, 64 streaming chat requests,
two cores): the API server process spent ~120-150 µs of CPU per token before, the event
loop's thread most of it; ~105-125 µs with this and the chat route's templated SSE chunks.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque

from mstar.contract import OutputEvent

_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


class Mailbox:
    """The events posted to one event loop from other threads, delivered in one callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._posted: list[tuple[AsyncSink, OutputEvent | None]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        with _mailboxes_lock:
            box = _mailboxes.get(loop)
            if box is None:
                box = _mailboxes[loop] = cls(loop)
            return box

    def post(self, sink: AsyncSink, event: OutputEvent | None) -> None:
        """From any thread: queue ``event`` for ``sink``; wake the loop if nothing is queued."""
        with self._lock:
            self._posted.append((sink, event))
            if len(self._posted) > 1:
                return  # a delivery is scheduled already and will take this one too
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            if not self.loop.is_closed():
                raise
            # The consumer's event loop is gone (it abandoned the request and its loop
            # ended): nobody can read this event. Raising here would kill the runtime's
            # emit or conductor thread and hang every later request.

    def _deliver(self) -> None:
        """On the loop: hand every queued event to its sink."""
        with self._lock:
            posted, self._posted = self._posted, []
        for sink, event in posted:
            sink.put(event)


class AsyncSink:
    """A runtime sink (``Runtime.submit``'s) whose events an asyncio task consumes: call it
    from any thread; ``await take()`` on the loop returns every event that is waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.mailbox = Mailbox.of(loop)
        self._events: deque[OutputEvent | None] = deque()
        self._waiter: asyncio.Future | None = None

    def __call__(self, event: OutputEvent | None) -> None:
        self.mailbox.post(self, event)

    def put(self, event: OutputEvent | None) -> None:
        """On the loop: add ``event`` and wake the consumer."""
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[OutputEvent | None]:
        """Every event waiting (at least one), oldest first; None closes the stream."""
        while not self._events:
            self._waiter = self.mailbox.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = list(self._events)
        self._events.clear()
        return events
