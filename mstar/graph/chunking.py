"""Chunk policies: when a stream edge has enough of its source to run its consumer.

A policy is a pure function of how many items the stream holds, how many chunks were
already taken and whether the producer has finished. It answers with the next chunk's
window ``[start, end)`` over the stream and the part of the consumer's output to keep,
or ``None`` when the consumer must wait. A closed stream always flushes what is left, so
a consumer never waits for a chunk that will not come.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One consumer run: items ``[start, end)`` of the stream; of the consumer's output
    for those items keep the items ``[keep_start, keep_end)`` (stream coordinates)."""

    index: int
    start: int
    end: int
    keep_start: int
    keep_end: int
    last: bool


def sized_chunk(want: int, context: int, available: int, taken: int, covered: int, closed: bool) -> Chunk | None:
    """The next chunk of a policy whose chunk ``taken`` covers ``want`` new frames behind
    ``context`` frames already sent (a short last chunk once the stream is closed); None while
    too few frames have arrived."""
    if available - covered >= want:
        end = covered + want
    elif closed and available > covered:
        end = available
    else:
        return None
    return Chunk(taken, max(0, covered - context), end, covered, end, closed and end == available)


class ChunkPolicy(ABC):
    @abstractmethod
    def next_chunk(self, available: int, taken: int, covered: int, closed: bool) -> Chunk | None:
        """``taken`` chunks were emitted so far and they kept items up to ``covered``."""

    def lookback(self) -> int | None:
        """The most items before ``covered`` a later chunk may read again (its left
        context); None: unknown, so every item is kept until the request ends."""
        return None


@dataclass(frozen=True)
class StreamClock:
    """A stream's timings as a ``TimedChunkPolicy`` sees them (seconds on the conductor's clock,
    taken when its results come in: no extra work on the workers)."""

    now: float = 0.0
    item_s: float | None = None  # wall time between the source's items (an average; None: unknown)
    chunk_s: float | None = None  # a chunk's time from dispatch to result (an average)
    # When a player of the output (``TimedChunkPolicy.item_play_s`` a source item) that started
    # at the first result and pauses whenever it runs dry has played all results so far; None:
    # no result yet, or nothing played. Past it (``now > played_until``) the player is dry.
    played_until: float | None = None
    last_items: int = 0  # source items the latest chunk result covered anew


class TimedChunkPolicy(ChunkPolicy):
    """A policy that also reads its stream's clock (a rate-aware codec ramp). Without a clock
    (``next_chunk``) it sees an unmeasured stream."""

    item_play_s: float = 0.0  # playback time of one source item's output (0: not played)

    @abstractmethod
    def next_timed_chunk(self, available: int, taken: int, covered: int, closed: bool,
                         clock: StreamClock) -> Chunk | None:
        """As ``next_chunk``, with the stream's ``clock``."""

    def next_chunk(self, available, taken, covered, closed):
        return self.next_timed_chunk(available, taken, covered, closed, StreamClock())


@dataclass(frozen=True)
class FixedFrames(ChunkPolicy):
    """Chunks of exactly ``size`` new items (the last one may be short)."""

    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"FixedFrames.size must be >= 1, got {self.size}")

    def next_chunk(self, available, taken, covered, closed):
        if available - covered >= self.size:
            end = covered + self.size
        elif closed and available > covered:
            end = available
        else:
            return None
        return Chunk(taken, covered, end, covered, end, closed and end == available)

    def lookback(self) -> int:
        return 0


@dataclass(frozen=True)
class GrowingChunks(ChunkPolicy):
    """Chunk sizes ``first, first*growth, ...`` capped at ``max_size``: a small first
    chunk for low latency, larger later ones for throughput. ``context`` earlier items
    are given to the consumer as left context and not kept."""

    first: int
    growth: float = 2.0
    max_size: int = 1 << 30
    context: int = 0

    def __post_init__(self) -> None:
        if self.first < 1 or self.growth < 1 or self.max_size < self.first or self.context < 0:
            raise ValueError("GrowingChunks needs first >= 1, growth >= 1, max_size >= first, context >= 0")

    def size_of(self, index: int) -> int:
        try:
            size = self.first * self.growth**index
        except OverflowError:  # a float growth**index past ~1e308: long since capped
            return self.max_size
        return int(min(self.max_size, size))

    def next_chunk(self, available, taken, covered, closed):
        return sized_chunk(self.size_of(taken), self.context, available, taken, covered, closed)

    def lookback(self) -> int:
        return self.context


@dataclass(frozen=True)
class SlidingWindow(ChunkPolicy):
    """Decode a ``window`` of items every ``stride`` new items and keep only the region
    the window decodes well (``keep="middle"``: the ``stride`` items before the last
    ``(window - stride) // 2`` items of look-ahead; ``"last"``: the newest ``stride``).

    The first chunk also keeps everything before its kept region, and the last chunk
    (when the producer closes) keeps everything after it, so the kept regions tile the
    whole stream exactly once.

    ``ahead`` sets the look-ahead of ``keep="middle"`` explicitly. ``align`` makes every
    window start a multiple of ``align`` items (a codec frame of several tokens): then
    window, stride and look-ahead must be multiples of it, and a final window may be up to
    ``align - 1`` items longer than ``window``.
    """

    window: int
    stride: int
    keep: str = "middle"
    ahead: int | None = None
    align: int = 1

    def __post_init__(self) -> None:
        if not (1 <= self.stride <= self.window):
            raise ValueError(f"SlidingWindow needs 1 <= stride <= window, "
                             f"got stride={self.stride}, window={self.window}")
        if self.keep not in ("middle", "last"):
            raise ValueError(f"SlidingWindow.keep must be 'middle' or 'last', got {self.keep!r}")
        if self.ahead is not None and not (0 <= self.ahead <= self.window - self.stride):
            raise ValueError(f"SlidingWindow.ahead must be in [0, window - stride], got {self.ahead}")
        if self.align < 1 or any(n % self.align for n in (self.window, self.stride, self.lookahead)):
            raise ValueError(f"SlidingWindow: window, stride and look-ahead must be multiples of align={self.align}")

    @property
    def lookahead(self) -> int:
        if self.keep == "last":
            return 0
        return (self.window - self.stride) // 2 if self.ahead is None else self.ahead

    def next_chunk(self, available, taken, covered, closed):
        if closed:
            if covered >= available:
                return None
            start = max(0, available - self.window) // self.align * self.align
            if start <= covered:
                return Chunk(taken, start, available, covered, available, True)
            # More is left than one window can hold (the producer closed while the
            # consumer lagged): keep taking regular chunks until the rest fits.
        # An open stream runs once the window reaches `lookahead` items past a full stride.
        end = covered + self.stride + self.lookahead
        if taken == 0:
            end = max(end, self.window)
            keep_end = end - self.lookahead
        else:
            keep_end = covered + self.stride
        if available < end:
            return None
        start = max(0, end - self.window)
        return Chunk(taken, start, end, covered, keep_end, False)


@dataclass(frozen=True)
class ScheduledChunks(ChunkPolicy):
    """Chunks of ``schedule[0], schedule[1], ...`` new items, then of ``size`` each, every one
    after up to ``context`` earlier items of left context (given to the consumer, not kept): a
    codec that starts with a short chunk for a fast first sound, then settles on one size.
    An empty ``schedule`` is plain ``size``-item chunks."""

    schedule: tuple[int, ...]
    size: int
    context: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", tuple(self.schedule))
        if self.size < 1 or self.context < 0 or any(n < 1 for n in self.schedule):
            raise ValueError("ScheduledChunks needs chunk sizes >= 1 and context >= 0")

    def size_of(self, index: int) -> int:
        return self.schedule[index] if index < len(self.schedule) else self.size

    def next_chunk(self, available, taken, covered, closed):
        return sized_chunk(self.size_of(taken), self.context, available, taken, covered, closed)

    def lookback(self) -> int:
        return self.context
