"""Ordered sentence pieces as one stream (``stream_pieces``), with fake pieces: events in piece
order whatever order the pieces run in, one finish at the end, a failed piece ending the
stream, at most ``ahead`` pieces running past the current one, and every piece cancelled when
the consumer leaves early."""

from __future__ import annotations

import asyncio

import pytest

from mstar.contract import OutputEvent, RequestError
from mstar.runtime.pieces import stream_pieces


class Pieces:
    """Piece ``i`` yields ``chunks`` audio events after ``delays[i]`` s each, then its finish
    (``finishes[i]``, default "stop"); ``raises`` names a piece that raises before any event."""

    def __init__(self, delays, chunks=2, finishes=None, raises=None):
        self.delays, self.chunks = delays, chunks
        self.finishes = finishes or {}
        self.raises = raises
        self.started: list[int] = []
        self.running: set[int] = set()
        self.most_running = 0
        self.closed: list[int] = []

    async def run(self, i, piece):
        self.started.append(i)
        self.running.add(i)
        self.most_running = max(self.most_running, len(self.running))
        try:
            if i == self.raises:
                raise RequestError("max_tokens", f"piece {i} does not fit")
            for c in range(self.chunks):
                await asyncio.sleep(self.delays[i])
                yield OutputEvent(modality="audio", data=bytes([i, c]))
            yield OutputEvent(modality="audio", finish_reason=self.finishes.get(i, "stop"))
        finally:
            self.running.discard(i)
            self.closed.append(i)


def collect(pieces: Pieces, n: int, ahead: int = 1, take: int | None = None) -> list[OutputEvent]:
    async def go():
        out = []
        stream = stream_pieces(list(range(n)), pieces.run, ahead)
        try:
            async for event in stream:
                out.append(event)
                if take is not None and len(out) == take:
                    break
        finally:
            await stream.aclose()
        return out

    return asyncio.run(go())


def test_events_come_in_piece_order_with_one_finish():
    pieces = Pieces(delays=[0.03, 0.0, 0.0])  # the second piece is done before the first
    events = collect(pieces, 3)
    assert [e.data for e in events if e.data] == [bytes([i, c]) for i in range(3) for c in range(2)]
    assert [e.finish_reason for e in events] == [None] * 6 + ["stop"]


def test_the_next_piece_runs_while_one_streams_and_no_more():
    for ahead in (0, 1, 2):
        pieces = Pieces(delays=[0.01] * 5)
        collect(pieces, 5, ahead=ahead)
        assert pieces.started == list(range(5)) and pieces.most_running == ahead + 1


def test_a_failed_piece_ends_the_stream_there():
    pieces = Pieces(delays=[0.0] * 3, finishes={1: "error"})
    events = collect(pieces, 3)
    assert [e.data for e in events if e.data] == [bytes([0, 0]), bytes([0, 1]), bytes([1, 0]), bytes([1, 1])]
    assert events[-1].finish_reason == "error" and pieces.running == set()  # piece 2 cancelled, if it began


def test_an_exception_is_raised_at_its_turn():
    pieces = Pieces(delays=[0.0] * 3, raises=1)
    got: list[OutputEvent] = []

    async def go():
        async for event in stream_pieces([0, 1, 2], pieces.run, 1):
            got.append(event)

    with pytest.raises(RequestError, match="piece 1"):
        asyncio.run(go())
    assert [e.data for e in got] == [bytes([0, 0]), bytes([0, 1])]  # piece 0 whole, its finish held back


def test_leaving_early_cancels_every_running_piece():
    pieces = Pieces(delays=[0.01, 10.0, 10.0])
    events = collect(pieces, 3, take=1)
    assert len(events) == 1 and pieces.running == set() and sorted(pieces.closed) == [0, 1]
