"""Streaming-aware scheduling: which streaming requests' producing steps run next.

A request whose walk streams media to its client (speech, a codec behind a talker) is
played back while it is made. Once its first media is out, what it needs is to stay ahead
of playback, not to be as fast as it can: a stream with seconds of audio buffered at the
client loses nothing by sitting out a step, and the rows it frees make the step shorter
for the streams that are close to running dry and for new requests, whose first chunk is
what their users wait for.

``held_streams`` is the policy, a pure function of each stream's media clock (``Pace``). Each
tick the conductor asks it which streaming requests' producing steps wait; their
stream-edge chunks (the codec windows of what they already made) are dispatched as usual.

* A stream without media yet (its first chunk not out) never waits, and comes first.
* A stream whose slack (media delivered minus media played since its first byte) is at
  least ``ahead_s`` waits: its buffer covers the next steps.
* With ``max_streams``, at most that many streaming requests step per tick: the ones
  without media first (oldest first), then by slack, least first (ties: oldest first).

Starvation-free: a waiting stream's slack falls as its audio plays while every stream that
steps gains media, so the least-slack order comes round to it (a test drives this under
hypothesis).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pace:
    """A streaming request's media clock: when its first media went to the client and how
    many seconds of media it has sent since the start."""

    started_at: float
    delivered_s: float

    def slack(self, now: float) -> float:
        """Seconds of media the client holds beyond what has played (negative: run dry)."""
        return self.delivered_s - (now - self.started_at)


def held_streams(streaming: Sequence[str], paces: Mapping[str, Pace], now: float, *, ahead_s: float,
                 max_streams: int | None = None) -> set[str]:
    """The requests of ``streaming`` (admission order) whose producing step waits this tick;
    ``paces`` holds the clocks of those whose first media is out."""
    fresh = [key for key in streaming if key not in paces]
    slack = {key: paces[key].slack(now) for key in streaming if key in paces}
    waiting = {key for key, s in slack.items() if s >= ahead_s}
    if max_streams is None:
        return waiting
    rank = {key: i for i, key in enumerate(streaming)}
    behind = sorted((key for key in slack if key not in waiting), key=lambda key: (slack[key], rank[key]))
    return waiting | set((fresh + behind)[max_streams:])
