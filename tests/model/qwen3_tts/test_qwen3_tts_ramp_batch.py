"""The adaptive codec ramp with many streams on one worker, where the windows chosen change the
rate every stream is made at (``codec_ramp: adaptive``, ``mstar.model.qwen3_tts.ramp``).

A tick is one plan: every open stream's talker step and the codec windows released in it. Its
time is a cost model with the shape of S12's on the H200 (docs/benchmarks.md, S12): a talker
step of ``17 + 0.56 n`` ms for ``n`` streams (about 18 ms at one, 35 at 32), and a codec call
of ``codec_call_ms`` per batch of packed windows (``packed_windows``: one a conv length, up to
32 rows, every graph captured at start). Each stream is the conductor's own ``StreamState``
(its clock, the edge's shared averages seeded by a one-stream warm-up), asked each tick as the
conductor asks it. A player starts at a stream's first sample and pauses when it runs dry.

On the H200 the first version fell into 1-frame windows at 32 streams (0.78x real time, 50
windows a stream, 0 viable). The same model with a graph captured mid-stream per new window
shape (about 100 ms each) and the old rule reproduces that, 133 ms first audio at one stream
included: its player never paused, so after one late window it counted the stream behind for
good and released each frame as it came, each a new shape and a codec call. The rule now sees
the player's real buffer and refills a dry player with at least the latest window's size; the
codec packs windows into few shapes, all captured at start."""

from __future__ import annotations

import random

import pytest

from mstar.graph import Step, StreamEdge
from mstar.model.qwen3_tts.engine import WINDOW_BUCKETS, conv_frames
from mstar.model.qwen3_tts.ramp import AdaptiveChunks, RampRule
from mstar.runtime.streams import EdgeTimes, StreamState

FRAME_S = 0.080
REACH = 10  # the released decoder's conv reach (frames)


def talker_ms(streams: int) -> float:
    return 17.0 + 0.56 * streams


def run_batch(streams: int, frames: int = 50, stagger_ms: float = 0.0, seed: int = 0,
              codec_call_ms: float = 2.0, margin: float = RampRule.margin, capture_ms: float | None = None) -> dict:
    """``streams`` requests of ``frames`` frames, the ``i``-th arriving up to ``stagger_ms``
    after the first; each stream's windows (arrival, size), stalls and first audio.
    ``capture_ms``: the codec as it was, a call per window length and context, each new one
    captured as a graph in ``capture_ms``."""
    policy = AdaptiveChunks(RampRule(margin=margin), context=72)
    edge = StreamEdge("codes", into=Step("codec", reads=("codes",), writes="audio"), policy=policy)
    times = EdgeTimes(item_s=0.0186, chunk_s=0.020)  # the warm-up's one stream
    rng = random.Random(seed)
    arrive = sorted(rng.uniform(0, stagger_ms / 1e3) for _ in range(streams))
    states: list[StreamState | None] = [None] * streams
    outs: list[list[tuple[float, int]]] = [[] for _ in range(streams)]
    now = 0.0
    captured: set = set()
    while True:
        for i, at in enumerate(arrive):
            if states[i] is None and at <= now:
                states[i] = StreamState(edge, edge_times=times)
        live = [s for s in states if s is not None]
        if len(live) == streams and all(s.closed and s.covered == frames and not s.running for s in live):
            break
        batches: dict[int, int] = {}  # rows a conv length
        running = []
        for i, state in enumerate(states):
            if state is None or state.running:
                continue
            state.observe(now)
            chunk = state.next_chunk()
            if chunk is not None:
                ref = state.take(chunk)
                running.append((i, state, chunk.keep_end - chunk.keep_start))
                lead = min(REACH, chunk.keep_start - chunk.start)
                key = conv_frames(chunk.keep_end - chunk.keep_start + lead) if capture_ms is None else \
                    (chunk.end - chunk.start, chunk.keep_start - chunk.start)
                batches[key] = batches.get(key, 0) + 1
                assert ref.versions
        making = [s for s in live if not s.closed]
        cost = talker_ms(len(making)) if making else 0.0
        cost += codec_call_ms * sum(-(-rows // WINDOW_BUCKETS[-1]) for rows in batches.values())
        if capture_ms is not None:
            cost += capture_ms * len(batches.keys() - captured)
            captured |= batches.keys()
        now += max(cost, 1.0) / 1e3
        for state in making:
            state.versions.append(len(state.versions) + 1)
            state.closed = len(state.versions) == frames
        for i, state, size in running:
            state.running = False
            outs[i].append((now, size))
    return {"outs": outs, "arrive": arrive}


def player(outs: list[tuple[float, int]]) -> tuple[float, float]:
    """First audio (s, from the first window's arrival) and total stall after it (s)."""
    until, stall = None, 0.0
    for at, size in outs:
        if until is not None and at > until:
            stall += at - until
        until = at + size * FRAME_S if until is None or at > until else until + size * FRAME_S
    return outs[0][0], stall


def summary(result: dict) -> tuple[int, float, float, float]:
    """Viable streams, the most windows a stream took, first audio p90 (ms) and total stall (ms)."""
    stalls, firsts, windows = [], [], []
    for at, outs in zip(result["arrive"], result["outs"]):
        first, stall = player(outs)
        stalls.append(stall)
        firsts.append((first - at) * 1e3)
        windows.append(len(outs))
    firsts.sort()
    return (sum(s <= 1e-9 for s in stalls), max(windows), firsts[int(0.9 * (len(firsts) - 1))], sum(stalls) * 1e3)


@pytest.mark.parametrize("streams,stagger_ms", [(1, 0.0), (8, 0.0), (32, 0.0)])
def test_every_stream_plays_through_at_the_s12_shapes(streams: int, stagger_ms: float) -> None:
    """S12's case (all at once): every player plays through."""
    viable, most_windows, first_p90, stall = summary(run_batch(streams, stagger_ms=stagger_ms))
    print(f"[ramp] {streams} streams (stagger {stagger_ms:g} ms): {viable} viable, first audio p90 "
          f"{first_p90:.0f} ms, stall {stall:.0f} ms, at most {most_windows} windows a stream")
    assert viable == streams
    assert most_windows <= 10


def test_arrivals_that_double_the_step_mid_window_keep_playing() -> None:
    """32 streams arriving within 300 ms: the first ones ramp up at one stream's rate, which
    halves as the rest join while their 8- and 16-frame windows are being made. A stream that
    joins starts from the edge's averages, a stand-in its first own measurement replaces: when
    it blended in instead (a quarter of the first interval against the stale averages), 13 of 32
    played through at the default margin and 29 at ``codec_ramp_margin: 1.0``; now 29 and all."""
    narrow = summary(run_batch(32, stagger_ms=300.0))
    wide = summary(run_batch(32, stagger_ms=300.0, margin=1.0))
    print(f"[ramp] 32 streams within 300 ms: {narrow[0]} viable at margin 0.2, {wide[0]} at 1.0")
    assert narrow[0] >= 28 and wide[0] == 32 and wide[1] <= 10


def test_a_joining_stream_measures_its_own_rate_at_once() -> None:
    """The edge's averages seed a new stream's clock; its first own interval replaces them."""
    policy = AdaptiveChunks(RampRule(), context=72)
    edge = StreamEdge("codes", into=Step("codec", reads=("codes",), writes="audio"), policy=policy)
    times = EdgeTimes(item_s=0.010, chunk_s=0.002)  # a fast batch before this stream joined
    state = StreamState(edge, edge_times=times)
    state.observe(0.0)
    assert state.clock.item_s == 0.010  # the stand-in
    state.versions.append(1)
    state.observe(0.050)  # the first item: when items start
    state.versions.append(2)
    state.observe(0.090)  # 40 ms an item in the bigger batch
    assert state.clock.item_s == pytest.approx(0.040) and times.item_s == pytest.approx(0.040)
    state.versions.append(3)
    state.observe(0.110)  # then its own measurements average
    assert state.clock.item_s == pytest.approx(0.040 + 0.25 * (0.020 - 0.040))


def test_graphs_captured_mid_stream_no_longer_drive_every_window_to_a_frame() -> None:
    """The H200's failure in this model: the codec keyed by each window's length and context,
    each new key a graph captured mid-stream (100 ms). With the old rule every stream took 50
    1-frame windows at 1, 8 and 32 streams; now a dry player refills and the windows grow."""
    for streams in (1, 8, 32):
        result = run_batch(streams, capture_ms=100.0)
        viable, most_windows, _, _ = summary(result)
        print(f"[ramp] {streams} streams, capture per new shape: {viable} viable, at most {most_windows} windows")
        assert most_windows <= 12
