"""The rate-aware codec ramp (``codec_ramp: adaptive``, ``mstar.model.qwen3_tts.ramp``).

A simulated stream: frame ``k`` is made at ``k * 80 / rho`` ms, one window is decoded at a
time and takes ``codec_ms``, the player starts at the first sample and plays on. The policy is
asked at every event (a frame made, a window decoded) through its stream-edge adapter, with
the clock the conductor would give it. Under hypothesis: at ``rho >= 1 + margin`` and a codec
window shorter than a frame, the player never runs dry; fast streams get the fixed ramp;
sizes stay in the allowed set; an ending stream flushes. At the 32-stream rate measured on the
H100 (1.32x real time) the fixed ramp runs dry and the adaptive one does not. The windows it
picks for a slow stream, joined, equal the whole decode of the tiny codec fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, StreamEdge, Walk
from mstar.graph.chunking import ChunkPolicy, ScheduledChunks, StreamClock, TimedChunkPolicy
from mstar.model.qwen3_tts.checkpoint import load_codec
from mstar.model.qwen3_tts.codec import Qwen3TTSCodec
from mstar.model.qwen3_tts.config import CodecConfig
from mstar.model.qwen3_tts.knobs import Qwen3TTSKnobs
from mstar.model.qwen3_tts.model import codec_policy
from mstar.model.qwen3_tts.ramp import AdaptiveChunks, RampRule, RampView
from mstar.runtime.conductor import Conductor, RequestSpec
from mstar.runtime.placement import NodeGroup, Placement
from mstar.runtime.protocol import ItemResult, StepResult
from mstar.runtime.streams import EdgeTimes, StreamState

FRAME = 80.0
RULE = RampRule()
ADAPTIVE = AdaptiveChunks(RULE, context=72)
FIXED = ScheduledChunks((1, 3, 8, 16), 25, 72)


def simulate(policy: ChunkPolicy, rho: float, codec_ms: float, frames: int) -> tuple[list[int], float, int]:
    """The windows' sizes, the player's worst lateness (ms; > 0: it ran dry after the first
    sample) and how many windows went out before the stream closed, for one stream of
    ``frames`` frames made at ``rho`` x real time."""
    step = FRAME / rho
    made = [(k + 1) * step for k in range(frames)]
    available = covered = taken = 0
    busy_until: float | None = None
    windows: list[tuple[float, int, int]] = []  # (audio out at, first frame, size)
    opened = 0
    until: float | None = None  # the player's (pausing when dry), as the conductor's clock keeps it
    for _ in range(20 * frames + 100):
        now = min([t for t in (made[available] if available < frames else None, busy_until) if t is not None])
        while available < frames and made[available] <= now:
            available += 1
        if busy_until is not None and busy_until <= now:
            busy_until = None
            play = windows[-1][2] * FRAME
            until = now + play if until is None or until < now else until + play
        closed = available == frames
        if busy_until is None:
            if isinstance(policy, TimedChunkPolicy):
                clock = StreamClock(now / 1e3, step / 1e3, codec_ms / 1e3, None if until is None else until / 1e3,
                                    windows[-1][2] if windows else 0)
                chunk = policy.next_timed_chunk(available, taken, covered, closed, clock)
            else:
                chunk = policy.next_chunk(available, taken, covered, closed)
            if chunk is not None:
                assert chunk.keep_start == covered and chunk.keep_end > covered
                windows.append((now + codec_ms, covered, chunk.keep_end - covered))
                covered, taken, busy_until = chunk.keep_end, taken + 1, now + codec_ms
                opened += not closed
                assert chunk.last == (closed and covered == frames)
        if closed and covered == frames and busy_until is None:
            break
    else:
        raise AssertionError("the stream never finished")
    start = windows[0][0]
    late = max((out - (start + FRAME * first) for out, first, _ in windows[1:]), default=0.0)
    return [size for _, _, size in windows], late, opened


@settings(max_examples=300, deadline=None)
@given(rho=st.floats(1 + RULE.margin + 1e-6, 40.0), codec_ms=st.floats(0.0, 79.9), frames=st.integers(1, 300))
def test_the_player_never_runs_dry_at_rho_above_one_plus_margin(rho: float, codec_ms: float, frames: int) -> None:
    sizes, late, _ = simulate(ADAPTIVE, rho, codec_ms, frames)
    assert late <= 1e-6, (sizes, late)
    assert sum(sizes) == frames
    assert all(size in RULE.allowed for size in sizes[:-1]) and sizes[-1] <= RULE.max_frames


@settings(max_examples=200, deadline=None)
@given(rho=st.floats(3 * (1 + RULE.margin), 60.0), share=st.floats(0.0, 1.0), frames=st.integers(1, 200))
def test_fast_streams_get_the_fixed_ramp(rho: float, share: float, frames: int) -> None:
    """From ``rho >= 3 (1 + margin)``, with a codec window that leaves the second window's wait
    room (``3 * pace + codec_ms <= 80``: the fixed ramp's binding step), the windows are the
    fixed ramp's (1, 3, 8, 16, then 25) while the stream is open; once it ends, the adaptive
    ramp flushes what is left in one window where the fixed one still steps through its sizes."""
    codec_ms = share * (FRAME - 3 * FRAME / rho * (1 + RULE.margin))
    sizes, late, opened = simulate(ADAPTIVE, rho, codec_ms, frames)
    fixed, _, fixed_opened = simulate(FIXED, rho, codec_ms, frames)
    assert opened == fixed_opened and sizes[:opened] == fixed[:opened] and late <= 1e-6
    assert len(sizes) - opened <= 1 + (frames - sum(sizes[:opened])) // 25


@pytest.mark.parametrize("codec_ms", [5.0, 30.0, 60.0])
def test_at_the_measured_32_stream_rate_only_the_adaptive_ramp_keeps_up(codec_ms: float) -> None:
    """S12 on the H100: 32 streams at 1.32x real time, 0 of 32 viable with the fixed ramp."""
    sizes, late, _ = simulate(FIXED, 1.32, codec_ms, 50)
    assert late > 20.0 and sizes[:3] == [1, 3, 8]
    sizes, late, _ = simulate(ADAPTIVE, 1.32, codec_ms, 50)
    assert late <= 0.0 and sizes[0] == 1 and min(sizes[1:4]) < 3, sizes


@pytest.mark.parametrize("rho", [0.5, 0.8, 1.1])
def test_a_slow_stream_holds_its_first_release_for_a_typical_utterance(rho: float) -> None:
    """Below ``1 + margin`` the first release waits for ``hold`` frames; an utterance of
    ``typical_frames`` then plays through, where releasing at once runs dry."""
    pace = FRAME / rho * (1 + RULE.margin)
    hold = RULE.hold(FRAME / rho)
    n = RULE.typical_frames
    assert hold == max(1, -int(-(n - FRAME * (n - 1) / pace) // 1))
    sizes, late, _ = simulate(ADAPTIVE, rho, 20.0, n)
    assert late <= 0.0 and sizes[0] == min(next(s for s in RULE.allowed + (hold,) if s >= hold), 25), sizes
    assert simulate(FIXED, rho, 20.0, n)[1] > 0


def test_release_rule_cases() -> None:
    """Flush on close (all that is made, up to the largest size), nothing to release without
    frames, the fixed ramp before any rate is measured, a refill when the player is about to
    run dry, and never above the fixed ramp's window."""
    assert RULE.release(RampView(800, 100, produced=5, windows=3, closed=True, frame_ms=60)) == 5
    assert RULE.release(RampView(800, 100, produced=30, windows=3, closed=True, frame_ms=60)) == 25
    assert RULE.release(RampView(800, 100, produced=0, windows=3, closed=True)) == 0
    starts = (0, 1, 4, 12, 28, 53)
    assert [RULE.target(RampView(FRAME * n, 0, 0, i)) for i, n in enumerate(starts)] == [1, 3, 8, 16, 25, 25]
    assert [RULE.cap(n) for n in (0, 1, 2, 3, 4, 11, 12, 27, 28, 500)] == [1, 3, 3, 3, 8, 8, 16, 16, 25, 25]
    # behind (10 ms left, a 30 ms window): all that is made goes out, never less than the latest
    # window, and a stream below 1 + margin x real time refills for the rest of an utterance
    assert RULE.release(RampView(400, 390, produced=7, windows=4, frame_ms=50, codec_ms=30, last=4)) == 6
    assert RULE.release(RampView(400, 390, produced=7, windows=4, frame_ms=50, codec_ms=30, last=8)) == 0
    assert RULE.release(RampView(400, 390, produced=8, windows=4, frame_ms=50, codec_ms=30, last=8)) == 8
    assert RULE.release(RampView(400, 390, produced=7, windows=4, frame_ms=70, codec_ms=30, last=4)) == 0
    assert RULE.release(RampView(80, 0, produced=2, windows=1, frame_ms=1)) == 0  # waits for 3
    assert RULE.release(RampView(80, 0, produced=3, windows=1, frame_ms=1)) == 3
    assert RampRule(max_frames=10).allowed == (1, 2, 3, 4, 6, 8, 10)


def test_without_a_clock_it_is_the_fixed_ramp() -> None:
    """An open stream not measured yet (``next_chunk``): the fixed ramp's windows."""
    for frames in (1, 9, 60, 90):
        steps = list(enumerate((0, 1, 4, 12, 28, 53)))
        assert [ADAPTIVE.next_chunk(frames, i, c, False) for i, c in steps] == \
               [FIXED.next_chunk(frames, i, c, False) for i, c in steps]


def test_the_knob_picks_the_policy() -> None:
    assert isinstance(codec_policy(Qwen3TTSKnobs()), ScheduledChunks)
    policy = codec_policy(Qwen3TTSKnobs(codec_ramp="adaptive", codec_chunk_frames=12, codec_ramp_margin=0.5))
    assert isinstance(policy, AdaptiveChunks) and policy.context == 72
    rule = policy.rule
    assert rule.allowed == (1, 2, 3, 4, 6, 8, 12) and rule.margin == 0.5 and rule.ramp == (1, 3, 8, 16)
    with pytest.raises(ValueError, match="codec_ramp"):
        Qwen3TTSKnobs(codec_ramp="fast")
    with pytest.raises(ValueError, match="positive|at least one"):
        Qwen3TTSKnobs(codec_window_sizes=[0, 4])


def test_the_stream_clock_averages_item_and_chunk_times() -> None:
    """The conductor's side: items seen 50 ms apart, a chunk back 30 ms after it went out; a
    second stream of the edge starts from the first's averages."""
    edge = StreamEdge("codes", into=Step("codec", reads=("codes",), writes="audio"), policy=ADAPTIVE)
    times = EdgeTimes()
    stream = StreamState(edge, edge_times=times)
    stream.observe(0.0)
    assert stream.clock == StreamClock(0.0, None, None, None)
    stream.versions += [1]
    stream.observe(0.05)
    chunk = stream.next_chunk()
    assert chunk is not None and chunk.end == 1  # unmeasured: the ramp's first frame
    stream.take(chunk)
    stream.versions += [2, 3]
    stream.observe(0.15)  # two items in 100 ms
    assert stream.clock.item_s == pytest.approx(0.05) and stream.clock.played_until is None
    stream.running = False
    stream.observe(0.18)
    assert stream.clock.chunk_s == pytest.approx(0.13) and stream.clock.played_until == pytest.approx(0.18 + 0.08)
    stream.versions += [4]
    stream.observe(0.25)  # 100 ms for one: the average moves a quarter of the way
    assert stream.clock.item_s == pytest.approx(0.05 + 0.25 * 0.05)
    other = StreamState(edge, edge_times=times)
    other.observe(1.0)
    assert other.clock.item_s == pytest.approx(stream.clock.item_s) and other.clock.chunk_s == pytest.approx(0.13)


@torch.no_grad()
def test_windows_of_a_slow_stream_join_to_the_whole_decode() -> None:
    """The tiny codec fixture (40 frames): the windows the adaptive ramp picks at rho 0.7 (a
    held first release, then what the shrinking buffer allows) and at 1.3, each decoded behind
    its left context (72: the whole clip), joined, equal the whole decode."""
    fixture = Path(__file__).parent / "fixtures" / "codec.safetensors"
    with safe_open(fixture, framework="pt") as f:
        config = json.loads(f.metadata()["config"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    codec = Qwen3TTSCodec(CodecConfig.from_hf_dict({"decoder_config": config})).eval()
    load_codec(codec, ((k, v) for k, v in tensors.items() if not k.startswith("fx.")))
    codes = tensors["fx.codes"]
    whole = codec(codes)
    for rho in (0.7, 1.3):
        sizes = simulate(ADAPTIVE, rho, 30.0, codes.shape[-1])[0]
        assert sizes != [1, 3, 8, 16, 12]
        out, start = [], 0
        for size in sizes:
            context = min(72, start)
            out.append(codec.decode_window(codes[..., start - context: start + size], context))
            start += size
        joined = torch.cat(out, dim=-1)
        err = ((joined - whole).abs().max() / whole.abs().max()).item()
        assert joined.shape == whole.shape and err < 1e-6, (sizes, err)


def conductor_run(policy: ChunkPolicy, rho: float, codec_ms: float, frames: int,
                  warm: int = 0) -> tuple[list[int], float]:
    """The conductor itself on fabricated results: a talker rank making a frame every
    ``80 / rho`` ms and a codec rank answering each window ``codec_ms`` later; the windows it
    took and the player's worst lateness (ms), its clock measured from those results alone.
    ``warm``: a request of that many frames runs first (the edge's averages then seed the
    measured one's clock)."""
    nodes = [Node("talker", "autoregressive", inputs=("prompt", "token"), outputs=("token", "codes"),
                  ops=("prefill", "decode"), flags=("stop",)),
             Node("codec", "stateless", inputs=("codes",), outputs=("audio",))]
    writes = {"token": "tok", "codes": "codes"}
    body = Sequential(Step("talker", "prefill", reads={"prompt": "prompt"}, writes=writes),
                      Loop(Step("talker", "decode", reads={"token": "tok"}, writes=writes), until="stop",
                           max_iters="max_decode_steps"))
    edge = StreamEdge("codes", into=Step("codec", reads=("codes",), writes="audio", emit=Emit("audio", "audio")),
                      policy=policy)
    graph = Graph.build(nodes, [Walk("tts", body, inputs=("prompt",), streams=[edge])])
    c = Conductor(graph, Placement(graph, (NodeGroup(("talker",), (0,)), NodeGroup(("codec",), (1,)))),
                  max_concurrent_requests=1)
    queue = [("warm", warm)] if warm else []
    queue.append(("measured", frames))
    c.submit(RequestSpec(queue[0][0], "tts", {"max_decode_steps": queue[0][1]}))
    now, made, pending, windows = 0.0, 0, [], []  # pending: (done at, result)
    while True:
        decisions = c.tick(now / 1e3)
        for rank, plan in decisions.plans.items():
            results = []
            for item in plan.items:
                if item.node == "talker":
                    made += 1
                    stop = made >= queue[0][1]
                    results.append(ItemResult(item.request_id, item.step, flags=["stop"] if stop else [],
                                              finish_reason="stop" if stop else None))
                else:
                    if item.request_id == "measured":
                        windows.append((now + codec_ms, item.chunk.keep_end - item.chunk.keep_start))
                    results.append(ItemResult(item.request_id, item.step, emitted=1))
            pending.append((now + (FRAME / rho if rank == 0 else codec_ms), StepResult(rank, plan.plan_id, results)))
        if decisions.finished:
            queue.pop(0)
            if not queue:
                break
            made = 0
            c.submit(RequestSpec(queue[0][0], "tts", {"max_decode_steps": queue[0][1]}))
            continue
        pending.sort(key=lambda p: p[0])
        now, result = pending.pop(0)
        c.on_result(result)
    sizes = [size for _, size in windows]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    late = max((out - (windows[0][0] + FRAME * start) for (out, _), start in zip(windows[1:], starts[1:])),
               default=0.0)
    return sizes, late


def test_the_conductor_times_the_stream_and_keeps_the_player_fed() -> None:
    """Through the conductor (its clock from the fabricated results' arrival times, nothing
    else), at the 32-stream rate: the fixed ramp runs dry, the adaptive one does not."""
    fixed, late = conductor_run(FIXED, 1.32, 20.0, 50)
    assert fixed == [1, 3, 8, 16, 22] and late > 100
    sizes, late = conductor_run(ADAPTIVE, 1.32, 20.0, 50)
    assert sum(sizes) == 50 and sizes[0] == 1 and min(sizes[1:4]) < 3 and late <= 0, (sizes, late)
    assert conductor_run(ADAPTIVE, 8.0, 5.0, 50)[0] == [1, 3, 8, 16, 22]


def test_through_the_conductor_a_slow_stream_holds_once_a_rate_is_known() -> None:
    """At 0.8x real time the measured stream, seeded by an earlier request's rate, holds its
    first release and plays through; the very first stream after start-up has no rate when
    its first frame comes and starts as the fixed ramp does (documented)."""
    sizes, late = conductor_run(ADAPTIVE, 0.8, 20.0, RULE.typical_frames, warm=3)
    assert sizes[0] == 25 and late <= 0, (sizes, late)
    sizes, late = conductor_run(ADAPTIVE, 0.8, 20.0, RULE.typical_frames)
    assert sizes[0] == 1 and late > 0
