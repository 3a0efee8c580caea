"""The codec's window sizes chosen from the stream's measured rate (``codec_ramp: adaptive``).

A frame is ``frame_audio_ms`` (80) ms of audio. A stream whose frames each take ``frame_ms`` of
wall time (its share of the batch, the codec's windows on the same worker, everything) is made
at ``rho = frame_audio_ms / frame_ms`` times real time. Its player starts at the first sample,
must never run dry, and pauses when it does (the conductor's clock replays it:
``StreamClock.played_until``). When the stream is asked for its next window, every window
released so far has been decoded (one window of a stream is in flight at a time), so the player
holds ``B = released_ms - played_ms``. Waiting for a window of ``s`` frames, ``produced`` of which
are made already, and decoding it takes ``(s - produced) * frame_ms + codec_ms``: the player
stays fed if that is at most ``B``. The rule pads the wait by ``margin`` (the rate is an
average of recent steps) and takes the largest allowed size that fits:

    (s - produced) * frame_ms * (1 + margin) + codec_ms <= B

The sizes come from a small fixed set (``ALLOWED_SIZES`` plus the ramp's and the largest), so
the codec's CUDA-graph shapes stay few, and a window is never larger than the fixed ramp's
window at that point of the stream (1 at frame 0, 3 from frame 1, 8 from 4, 16 from 12, then
25): a fast stream gets exactly the fixed ramp. That ramp needs
``rho >= 3`` for its second window (3 frames made while 1 plays), 2.75, 2.25, 1.86 and 1.45
for the next ones, so with the margin the adaptive rule reproduces it from
``rho >= 3 * (1 + margin)`` (and a codec window short against a frame); below that it picks
smaller windows, which grow again as the player's buffer does (each frame adds 80 ms of
audio in ``frame_ms``).

Re-asking the rule as time passes is consistent: at a steady rate the buffer drains as fast
as the wait shrinks, so a size that fits stays fitting until its frames are made; if the rate
drops, the target shrinks and what is made goes out sooner. When nothing fits (the player runs
dry whatever goes out now) the stream refills: it waits for ``hold`` frames (below), and never
for fewer than its latest window (all that is made goes out if more). Releasing each frame as it
came instead cost a codec call a frame, which on a worker shared by 32 streams slowed all of
them, so that they stayed behind: S12 on the H200 fell into 1-frame windows that way (a player
that never paused made it worse: one late window counted the stream behind for good).

**Holding the first release.** The first window waits until ``hold`` frames are made:

* one frame, or enough to cover the second window's wait: ``ceil(max(pace, codec_ms) / 80)``
  with ``pace = frame_ms * (1 + margin)``;
* when even one frame cannot keep up (``pace > 80``: rho below ``1 + margin``), enough that the
  rest of a typical utterance of ``typical_frames`` frames (a knob; 125 = 10 s) does not
  stall: frame ``P + j`` is out ``j * pace`` after the first release while its audio plays
  ``80 * (P + j - 1)`` ms after the first sample (the codec's time is on both sides), so
  ``P >= N - 80 * (N - 1) / pace``. A longer utterance may still stall near its end; a shorter
  one closes first and flushes.

Rounded up to an allowed size; past the largest the first windows go out back to back.

An ending stream (``closed``) flushes: all it has made, up to the largest size, whatever the
set (the last window is whatever is left). Before any rate is measured (``frame_ms`` None)
the fixed ramp is followed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mstar.graph.chunking import Chunk, StreamClock, TimedChunkPolicy, sized_chunk

ALLOWED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 25)
FIXED_RAMP = (1, 3, 8, 16)


@dataclass(frozen=True)
class RampView:
    """What the rule sees of one stream when asked for its next window."""

    released_ms: float  # audio of the windows released (and decoded) so far
    played_ms: float  # audio the player has played since the first sample (it pauses when dry)
    produced: int  # frames made and not in a window yet
    windows: int  # windows released so far
    closed: bool = False  # the stream has ended: no more frames come
    frame_ms: float | None = None  # wall time per frame of this stream (an average), None: unknown
    codec_ms: float = 0.0  # a window's time from its release to its audio (an average)
    last: int = 0  # frames of the latest window


@dataclass(frozen=True)
class RampRule:
    """The adaptive ramp's parameters; ``release`` is the rule (see the module docstring)."""

    ramp: tuple[int, ...] = FIXED_RAMP  # the fixed ramp's first windows: the upper bound of window i
    max_frames: int = 25  # the largest window (``codec_chunk_frames``)
    sizes: tuple[int, ...] = ALLOWED_SIZES  # window sizes besides the ramp's and the largest
    margin: float = 0.2  # the wait padded by this share of itself
    typical_frames: int = 125  # the utterance the first release's hold plans for (slow streams)
    frame_audio_ms: float = 80.0  # audio of one frame
    allowed: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_frames < 1 or self.margin < 0 or self.typical_frames < 1 or self.frame_audio_ms <= 0:
            raise ValueError("RampRule needs max_frames >= 1, margin >= 0, typical_frames >= 1 and a frame's audio")
        if any(n < 1 for n in (*self.ramp, *self.sizes)):
            raise ValueError(f"window sizes must be positive, got {self.ramp} and {self.sizes}")
        allowed = sorted({n for n in (*self.sizes, *self.ramp, self.max_frames) if n <= self.max_frames})
        object.__setattr__(self, "allowed", tuple(allowed))

    def cap(self, released: int) -> int:
        """The largest size of the window after ``released`` frames: the fixed ramp's window
        that would start there (1 at 0, 3 from 1, 8 from 4, 16 from 12), then ``max_frames``."""
        start = 0
        for size in self.ramp:
            if released < start + size:
                return min(size, self.max_frames)
            start += size
        return self.max_frames

    def hold(self, frame_ms: float | None, codec_ms: float = 0.0) -> int:
        """Frames the first window waits for (see the module docstring)."""
        if frame_ms is None:
            return self.cap(0)
        pace, audio, n = frame_ms * (1 + self.margin), self.frame_audio_ms, self.typical_frames
        need = max(self.cap(0), _ceil(max(pace, codec_ms) / audio))
        if pace > audio:
            need = max(need, _ceil(n - audio * (n - 1) / pace))
        return need

    def target(self, view: RampView) -> int:
        """The size the stream's next window aims for now (released once that many are made)."""
        if view.windows == 0:
            need = self.hold(view.frame_ms, view.codec_ms)
            return next((n for n in self.allowed if n >= need), need)
        cap = self.cap(round(view.released_ms / self.frame_audio_ms))
        if view.frame_ms is None:
            return cap
        buffer = view.released_ms - view.played_ms
        pace = view.frame_ms * (1 + self.margin)
        fits = [n for n in self.allowed if n <= cap and max(0, n - view.produced) * pace + view.codec_ms <= buffer]
        if fits:
            return fits[-1]
        # behind: the player runs dry whatever goes out now. Refill it as a first release would
        # (``hold``), never with less than the latest window, or all that is made (up to the
        # ramp's window): releasing each frame as it comes costs a codec call a frame, which on
        # a shared worker slows every stream, which keeps them behind
        floor = max(self.hold(view.frame_ms, view.codec_ms), view.last)
        return max(next((n for n in self.allowed if n >= floor), floor), self.largest_within(min(view.produced, cap)))

    def largest_within(self, frames: int) -> int:
        """The largest allowed size of at most ``frames`` frames (0: none)."""
        return next((n for n in reversed(self.allowed) if n <= frames), 0)

    def release(self, view: RampView) -> int:
        """Frames to release now as the next window (0: wait): ``target`` once made, never more
        than ``max_frames``; an ending stream flushes what it has made."""
        if view.produced <= 0:
            return 0
        if view.closed:
            return min(view.produced, self.max_frames)
        want = self.target(view)
        if view.produced < want:  # the first window's hold may exceed the largest size
            return 0
        return self.largest_within(min(want, view.produced, self.max_frames))


def _ceil(x: float) -> int:
    return max(1, math.ceil(x - 1e-9))


@dataclass(frozen=True)
class AdaptiveChunks(TimedChunkPolicy):
    """The codec's stream-edge policy under ``codec_ramp: adaptive``: ``rule.release`` on the
    stream's clock (the conductor's timings of its items and windows), each window behind up
    to ``context`` frames already spoken."""

    rule: RampRule
    context: int = 0

    @property
    def item_play_s(self) -> float:
        return self.rule.frame_audio_ms / 1e3

    def next_timed_chunk(self, available: int, taken: int, covered: int, closed: bool,
                         clock: StreamClock) -> Chunk | None:
        released = covered * self.rule.frame_audio_ms
        held = 0.0 if clock.played_until is None else max(0.0, clock.played_until - clock.now) * 1e3
        view = RampView(released_ms=released, played_ms=released - held,
                        produced=available - covered, windows=taken, closed=closed,
                        frame_ms=None if clock.item_s is None else clock.item_s * 1e3,
                        codec_ms=0.0 if clock.chunk_s is None else clock.chunk_s * 1e3, last=clock.last_items)
        size = self.rule.release(view)
        return sized_chunk(size, self.context, available, taken, covered, closed) if size else None

    def lookback(self) -> int:
        return self.context
