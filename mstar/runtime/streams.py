"""Stream edges at run time: the conductor's bookkeeping for one request's stream.

The producer's writes of the source variable are the stream's items, known by version.
The edge's chunk policy decides when the consumer runs and over which items; one chunk
of an edge is in flight at a time, so chunks reach the client in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.graph import StreamEdge
from mstar.graph.chunking import Chunk
from mstar.runtime.protocol import ChunkRef


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

    def next_chunk(self) -> Chunk | None:
        if self.running:
            return None
        return self.edge.policy.next_chunk(len(self.versions), self.taken, self.covered, self.closed)

    def take(self, chunk: Chunk) -> ChunkRef:
        self.running = True
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
