"""Streaming-aware scheduling (``mstar.runtime.pacing.held_streams``): the policy alone, a pure
function, and a simulation of streams played back while they are made."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.runtime.pacing import Pace
from mstar.runtime.pacing import held_streams as held


def test_new_streams_never_wait_and_come_first():
    paces = {"a": Pace(0.0, 5.0), "b": Pace(0.0, 1.2)}
    # at t=1: a holds 4 s of slack (waits), b 0.2 s, c and d have no media yet
    assert held(["a", "b", "c", "d"], paces, 1.0, ahead_s=2.0) == {"a"}
    assert held(["a", "b", "c", "d"], paces, 1.0, ahead_s=2.0, max_streams=2) == {"a", "b"}
    assert held(["a", "b", "c", "d"], paces, 1.0, ahead_s=2.0, max_streams=3) == {"a"}


def test_least_slack_steps_first_under_a_cap():
    paces = {k: Pace(0.0, d) for k, d in zip("abcd", (1.5, 1.1, 1.9, 1.1))}
    # slack at t=1: a 0.5, b 0.1, c 0.9, d 0.1 (ties in admission order: b before d)
    assert held(list("abcd"), paces, 1.0, ahead_s=10.0, max_streams=1) == {"a", "c", "d"}
    assert held(list("abcd"), paces, 1.0, ahead_s=10.0, max_streams=3) == {"c"}
    assert held(list("abcd"), paces, 1.0, ahead_s=10.0) == set()


def test_a_stream_run_dry_steps():
    assert held(["a"], {"a": Pace(0.0, 1.0)}, 3.0, ahead_s=0.5) == set()  # slack -2 s


def simulate(arrivals: list[int], ahead_s: float, cap: int | None, step_s: float, media_per_step_s: float,
             first_steps: int, ticks: int) -> tuple[float, int]:
    """Streams arriving at the given ticks, each stepped when not held; a stepped stream
    makes ``media_per_step_s`` of media, all sent once it has made ``first_steps`` steps.
    Returns the least slack any stream had once its media started, and how many times a
    stream held for the cap had less slack than one that stepped."""
    made: dict[str, int] = {}
    paces: dict[str, Pace] = {}
    least, inversions = 0.0, 0
    for tick in range(ticks):
        now = tick * step_s
        streaming = [f"s{i}" for i, at in enumerate(arrivals) if at <= tick]
        wait = held(streaming, paces, now, ahead_s=ahead_s, max_streams=cap)
        stepped = [key for key in streaming if key not in wait]
        for key in wait:  # held for the cap, not for being ahead
            if key in paces and paces[key].slack(now) < ahead_s and all(k in paces for k in stepped):
                inversions += sum(paces[k].slack(now) > paces[key].slack(now) for k in stepped)
        least = min([least] + [paces[key].slack(now) for key in streaming if key in paces])
        for key in stepped:
            made[key] = made.get(key, 0) + 1
            if made[key] >= first_steps:
                start = paces[key].started_at if key in paces else now + step_s
                paces[key] = Pace(start, made[key] * media_per_step_s)
    return least, inversions


@settings(max_examples=300, deadline=None)
@given(arrivals=st.lists(st.integers(0, 30), min_size=1, max_size=12), data=st.data(),
       ahead_s=st.floats(0.05, 3.0), step_s=st.floats(0.005, 0.05), headroom=st.floats(1.0, 5.0),
       first_steps=st.integers(1, 8))
def test_no_stream_starves(arrivals, data, ahead_s, step_s, headroom, first_steps):
    """Whenever the cap can make media as fast as every stream plays it, no stream runs dry
    by more than the first chunks of streams arriving meanwhile (they come first) plus a
    turn through the cap, however they arrive; and a stream held for the cap never has
    less slack than one that steps."""
    n = len(arrivals)
    cap = data.draw(st.integers(1, n))
    media_per_step_s = step_s * n / cap * headroom  # the cap's output keeps up with playback
    least, inversions = simulate(arrivals, ahead_s, cap, step_s, media_per_step_s, first_steps, ticks=400)
    assert inversions == 0
    assert least >= -(-(-n // cap) * first_steps + 1) * step_s


@settings(max_examples=60, deadline=None)
@given(arrivals=st.lists(st.integers(0, 30), min_size=1, max_size=12), cap=st.integers(1, 12),
       step_s=st.floats(0.005, 0.05), media_ratio=st.floats(0.1, 1.0))
def test_least_slack_first_when_the_cap_cannot_keep_up(arrivals, cap, step_s, media_ratio):
    """Overloaded, streams run dry, but the held ones are never the neediest."""
    _, inversions = simulate(arrivals, 1.0, cap, step_s, media_ratio * step_s, 2, ticks=300)
    assert inversions == 0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), ahead_s=st.floats(0.1, 2.0), media_ratio=st.floats(1.5, 20.0))
def test_streams_fast_enough_stay_ahead_and_step_less(n, ahead_s, media_ratio):
    """When a stream makes media faster than it plays, pacing keeps its buffer near
    ``ahead_s`` and it sits out steps instead of racing ahead."""
    step_s = 0.01
    made = {f"s{i}": 0 for i in range(n)}
    paces: dict[str, Pace] = {}
    for tick in range(400):
        now = tick * step_s
        wait = held(list(made), paces, now, ahead_s=ahead_s)
        for key in made:
            if key not in wait:
                made[key] += 1
                start = paces[key].started_at if key in paces else now + step_s
                paces[key] = Pace(start, made[key] * media_ratio * step_s)
    now = 400 * step_s
    for key, pace in paces.items():
        assert 0 <= pace.slack(now) <= ahead_s + media_ratio * step_s
        assert made[key] < 400
