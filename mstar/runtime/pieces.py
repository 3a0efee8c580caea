"""One request spoken as ordered pieces (long text cut at sentences, one walk per piece),
streamed to the client as one response.

The pieces' events go out in piece order, and only the last piece's finish ends the stream:
a piece that finishes normally (``stop`` or ``length``) hands over to the next. A piece that
fails or is cancelled ends the stream there, with its event. ``ahead`` pieces past the one
streaming are already running, so the next piece's first audio is ready when the current
one ends (no gap in playback for a model that synthesises faster than real time); their
events wait in memory until their turn. However the consumer stops, every piece still
running is cancelled (its walk is cancelled by its own iterator's cleanup).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import TypeVar

from mstar.contract import OutputEvent

__all__ = ["stream_pieces"]

P = TypeVar("P")
_DONE = object()


def _ends_early(event: OutputEvent) -> bool:
    return event.error is not None or event.finish_reason not in (None, "stop", "length")


async def stream_pieces(pieces: Sequence[P], run: Callable[[int, P], AsyncIterator[OutputEvent]],
                        ahead: int = 1) -> AsyncIterator[OutputEvent]:
    """The events of ``run(i, piece)`` for each piece in order, as one stream (module doc)."""
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in pieces]
    tasks: list[asyncio.Task] = []

    async def pump(i: int) -> None:
        try:
            async with aclosing(run(i, pieces[i])) as events:
                async for event in events:
                    queues[i].put_nowait(event)
        except Exception as exc:  # raised again in order, at the piece's turn
            queues[i].put_nowait(exc)
        finally:
            queues[i].put_nowait(_DONE)

    try:
        for i in range(len(pieces)):
            while len(tasks) < min(i + 1 + ahead, len(pieces)):
                tasks.append(asyncio.ensure_future(pump(len(tasks))))
            last = i == len(pieces) - 1
            while (item := await queues[i].get()) is not _DONE:
                if isinstance(item, Exception):
                    raise item
                event: OutputEvent = item
                if _ends_early(event) or last:
                    yield event
                    if _ends_early(event):
                        return
                elif event.finish_reason:  # this piece is done; the next one carries on
                    if event.data or event.text:
                        yield OutputEvent(modality=event.modality, data=event.data, text=event.text)
                else:
                    yield event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
