"""Stream edges at run time: the conductor's bookkeeping for one request's stream.

The producer's writes of the source variable are the stream's items, known by version.
The edge's chunk policy decides when the consumer runs and over which items; one chunk
of an edge is in flight at a time, so chunks reach the client in order.

A ``TimedChunkPolicy`` also reads the stream's clock: each tick, before asking it, the
conductor notes (``observe``) when new items arrived and when a chunk's result came back, on
its own clock; averages over the edge's streams seed a new stream's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.graph import StreamEdge
from mstar.graph.chunking import Chunk, StreamClock, TimedChunkPolicy
from mstar.runtime.protocol import ChunkRef

TIMING_WEIGHT = 0.25  # the newest interval's weight in a stream's running averages


@dataclass
class EdgeTimes:
    """The latest averages of any stream of one edge: a new stream's first estimates."""

    item_s: float | None = None
    chunk_s: float | None = None


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + TIMING_WEIGHT * (new - old)


@dataclass
class StreamState:
    edge: StreamEdge
    versions: list[int] = field(default_factory=list)  # version of each item, in order
    taken: int = 0
    covered: int = 0
    closed: bool = False
    running: bool = False
    # Whether the consumer's rank may free items no later chunk reads (only this edge reads
    # the source: see ``Conductor``), and how many leading items it was told to free so far.
    droppable: bool = False
    dropped: int = 0
    # A timed policy's clock (``observe``): the edge's shared averages, this stream's own, and
    # the bookkeeping behind them (items seen and when, when the running chunk was taken).
    edge_times: EdgeTimes | None = None
    clock: StreamClock = field(default_factory=StreamClock)
    seen: int = 0
    seen_at: float | None = None
    # whether the clock's averages are this stream's own yet: until its first measurement they
    # are the edge's, a stand-in (a stream that joins a bigger batch is made slower than the
    # streams before it were), so the first measurement replaces them instead of blending in
    own_item_s: bool = False
    own_chunk_s: bool = False
    taken_at: float | None = None
    out_covered: int = 0  # items covered by the chunk results in so far
    # whether the policy is timed, asked twice per tick (an ABC's isinstance is slow)
    timed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.timed = isinstance(self.edge.policy, TimedChunkPolicy)

    def observe(self, now: float) -> None:
        """Note the items and chunk results that came in since the last tick (timed policies only)."""
        if not self.timed:
            return
        shared = self.edge_times or EdgeTimes()
        clock = self.clock
        item_s, chunk_s, until, last = clock.item_s, clock.chunk_s, clock.played_until, clock.last_items
        if len(self.versions) > self.seen:
            if self.seen_at is not None:
                interval = (now - self.seen_at) / (len(self.versions) - self.seen)
                item_s = shared.item_s = _average(item_s if self.own_item_s else None, interval)
                self.own_item_s = True
            self.seen, self.seen_at = len(self.versions), now
        if self.taken_at is not None and not self.running:
            chunk_s = shared.chunk_s = _average(chunk_s if self.own_chunk_s else None, now - self.taken_at)
            self.own_chunk_s = True
            last, self.out_covered = self.covered - self.out_covered, self.covered  # one chunk runs at a time
            play = last * self.edge.policy.item_play_s
            if play > 0:  # the player plays on, or restarts now if it ran dry before this result
                until = now + play if until is None or until < now else until + play
            self.taken_at = None
        self.clock = StreamClock(now, item_s if item_s is not None else shared.item_s,
                                 chunk_s if chunk_s is not None else shared.chunk_s, until, last)

    def next_chunk(self) -> Chunk | None:
        if self.running:
            return None
        policy = self.edge.policy
        if self.timed:
            return policy.next_timed_chunk(len(self.versions), self.taken, self.covered, self.closed, self.clock)
        return policy.next_chunk(len(self.versions), self.taken, self.covered, self.closed)

    def take(self, chunk: Chunk) -> ChunkRef:
        self.running = True
        self.taken_at = self.clock.now
        self.taken += 1
        self.covered = chunk.keep_end
        last = self.closed and chunk.keep_end >= len(self.versions)
        drop: list[int] = []
        lookback = self.edge.policy.lookback() if self.droppable else None
        if lookback is not None:
            upto = max(self.dropped, self.covered - lookback)
            drop, self.dropped = self.versions[self.dropped:upto], upto
        return ChunkRef(
            port=self.edge.chunk_port,
            var=self.edge.source,
            versions=self.versions[chunk.start:chunk.end],
            index=chunk.index,
            keep_start=chunk.keep_start - chunk.start,
            keep_end=chunk.keep_end - chunk.start,
            last=last,
            drop=drop,
        )

    @property
    def drained(self) -> bool:
        return self.closed and not self.running and self.next_chunk() is None
