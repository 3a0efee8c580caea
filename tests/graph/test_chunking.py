"""Chunk policies driven by simulated producers: tiling, windows, flushing, exact chunks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.graph import Chunk, ChunkPolicy, FixedFrames, GrowingChunks, ScheduledChunks, SlidingWindow

POLICIES = [
    FixedFrames(1),
    FixedFrames(4),
    FixedFrames(7),
    GrowingChunks(first=1),
    GrowingChunks(first=2, growth=2.0, max_size=10),
    GrowingChunks(first=3, growth=1.5, max_size=16, context=2),
    GrowingChunks(first=4, growth=1.0, context=5),
    SlidingWindow(window=28, stride=7, keep="middle"),
    SlidingWindow(window=28, stride=7, keep="last"),
    SlidingWindow(window=8, stride=3, keep="middle"),
    SlidingWindow(window=5, stride=5, keep="middle"),
    SlidingWindow(window=1, stride=1, keep="last"),
    SlidingWindow(window=6, stride=1, keep="middle"),
    ScheduledChunks((12, 13), 25, context=25),
    ScheduledChunks((), 25, context=25),
    ScheduledChunks((1, 2), 3),
]
IDS = [repr(p) for p in POLICIES]


class Stream:
    """The conductor's side of one stream edge: items arrive, chunks are taken."""

    def __init__(self, policy: ChunkPolicy):
        self.policy = policy
        self.available = 0
        self.closed = False
        self.taken = 0
        self.covered = 0
        self.chunks: list[Chunk] = []
        self.offered_at: list[int] = []  # `available` when each chunk was offered
        self.closed_at: list[bool] = []  # whether the stream was closed then

    def drain(self) -> list[Chunk]:
        out = []
        for _ in range(self.available + 2):
            chunk = self.policy.next_chunk(self.available, self.taken, self.covered, self.closed)
            if chunk is None:
                return out
            check_chunk(self.policy, chunk, self.available, self.taken, self.covered, self.closed)
            self.chunks.append(chunk)
            self.offered_at.append(self.available)
            self.closed_at.append(self.closed)
            self.taken += 1
            self.covered = chunk.keep_end
            out.append(chunk)
        raise AssertionError("policy keeps offering chunks without progress")

    def take_one(self) -> Chunk | None:
        chunk = self.policy.next_chunk(self.available, self.taken, self.covered, self.closed)
        if chunk is not None:
            check_chunk(self.policy, chunk, self.available, self.taken, self.covered, self.closed)
            self.chunks.append(chunk)
            self.offered_at.append(self.available)
            self.closed_at.append(self.closed)
            self.taken += 1
            self.covered = chunk.keep_end
        return chunk


def check_chunk(policy, chunk: Chunk, available, taken, covered, closed) -> None:
    assert chunk.index == taken
    # the chunk only covers items that exist
    assert 0 <= chunk.start <= chunk.keep_start < chunk.keep_end <= chunk.end <= available, chunk
    # kept regions continue exactly where the last one stopped
    assert chunk.keep_start == covered, chunk
    if not closed:
        assert chunk.last is False, chunk
    else:
        assert chunk.last == (chunk.keep_end == available), chunk
    if isinstance(policy, FixedFrames):
        assert chunk.start == chunk.keep_start
        assert chunk.end == chunk.keep_end
        assert chunk.end - chunk.start <= policy.size
        if not closed:
            assert chunk.end - chunk.start == policy.size
    elif isinstance(policy, GrowingChunks):
        assert chunk.start == max(0, chunk.keep_start - policy.context)
        assert chunk.end == chunk.keep_end
        kept = chunk.keep_end - chunk.keep_start
        assert kept <= policy.size_of(chunk.index)
        if not closed:
            assert kept == policy.size_of(chunk.index)
    elif isinstance(policy, SlidingWindow):
        assert chunk.end - chunk.start <= policy.window, chunk
        if not chunk.last:
            assert chunk.end - chunk.start == policy.window, chunk  # a full window
            # leaves `lookahead` decoded items of right context unkept
            assert chunk.end - chunk.keep_end == policy.lookahead, chunk
        if chunk.index > 0 and not chunk.last:
            assert chunk.keep_end - chunk.keep_start == policy.stride, chunk


def check_tiling(chunks: list[Chunk], total: int) -> None:
    pos = 0
    for chunk in chunks:
        assert chunk.keep_start == pos, (chunks, total)
        pos = chunk.keep_end
    assert pos == total
    kept = [i for c in chunks for i in range(c.keep_start, c.keep_end)]
    assert kept == list(range(total))
    # and the windows contain their kept regions
    assert all(c.start <= c.keep_start and c.keep_end <= c.end for c in chunks)


def one_by_one(policy: ChunkPolicy, total: int, close_with_last: bool) -> Stream:
    s = Stream(policy)
    if total == 0:
        s.closed = True
        s.drain()
        return s
    for i in range(total):
        s.available += 1
        if close_with_last and i == total - 1:
            s.closed = True
        got = s.drain()
        if not s.closed:
            # an open stream offers at most one chunk per new item, at the moment its
            # last needed item arrives (never later than needed)
            assert len(got) <= 1
            if got:
                assert got[0].end == s.available
    if not close_with_last:
        s.closed = True
        s.drain()
    return s


def assert_finished(s: Stream, total: int) -> None:
    assert s.covered == total
    check_tiling(s.chunks, total)
    # after closing, nothing is pending: the consumer never waits for a chunk that will not come
    assert s.policy.next_chunk(total, s.taken, s.covered, True) is None
    # exactly the chunks at the end may be flagged last, and only the very final one
    lasts = [c.last for c in s.chunks]
    assert lasts.count(True) <= 1
    if True in lasts:
        assert lasts[-1] is True
    # every chunk taken after the close reaches the end last and is the final one
    after_close = [c for c, closed in zip(s.chunks, s.closed_at) if closed]
    if after_close:
        assert after_close[-1] is s.chunks[-1]
        assert s.chunks[-1].last is True
        assert s.chunks[-1].end == total


# --------------------------------------------------------------------------- all policies


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_producer_closing_with_its_last_item_at_every_length(policy):
    for total in range(0, 70):
        s = one_by_one(policy, total, close_with_last=True)
        assert_finished(s, total)
        if total == 0:
            assert s.chunks == []
        else:
            assert s.chunks[-1].last is True
            assert s.chunks[-1].end == total
            assert [c.last for c in s.chunks] == [False] * (len(s.chunks) - 1) + [True]


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_producer_closing_after_its_last_item_at_every_length(policy):
    for total in range(0, 70):
        s = one_by_one(policy, total, close_with_last=False)
        assert_finished(s, total)
        if total and s.chunks[-1].last is False:
            # the close found nothing left: the last chunk (taken while open) ended at total
            assert s.closed_at[-1] is False
            assert s.chunks[-1].keep_end == total


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_nothing_is_offered_before_enough_items(policy):
    s = Stream(policy)
    assert policy.next_chunk(0, 0, 0, False) is None
    assert policy.next_chunk(0, 0, 0, True) is None
    first_needed = {
        FixedFrames: lambda p: p.size,
        GrowingChunks: lambda p: p.first,
        SlidingWindow: lambda p: p.window,
        ScheduledChunks: lambda p: p.size_of(0),
    }[type(policy)](policy)
    for n in range(first_needed):
        assert policy.next_chunk(n, 0, 0, False) is None
    assert policy.next_chunk(first_needed, 0, 0, False) is not None
    del s


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_producer_closes_in_one_burst_consumer_takes_everything_after(policy):
    # the consumer lagged: the whole stream, already closed, is there at the first call
    for total in range(0, 120):
        s = Stream(policy)
        s.available = total
        s.closed = True
        s.drain()
        assert_finished(s, total)
        if total:
            assert s.chunks[-1].last is True


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    arrivals=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3)), max_size=25),
    close_with_last=st.booleans(),
)
def test_bursty_producer_and_lagging_consumer(policy, arrivals, close_with_last):
    """Items arrive in bursts; after each burst the consumer takes only a few chunks."""
    s = Stream(policy)
    for k, (burst, takes) in enumerate(arrivals):
        s.available += burst
        if close_with_last and k == len(arrivals) - 1:
            s.closed = True
        for _ in range(takes):
            if s.take_one() is None:
                break
    s.closed = True
    s.drain()
    total = s.available
    assert_finished(s, total)
    assert s.policy.next_chunk(total, s.taken, s.covered, True) is None


# --------------------------------------------------------------------------- FixedFrames


def test_fixed_frames_exact_chunks():
    s = one_by_one(FixedFrames(4), 10, close_with_last=False)
    assert s.chunks == [
        Chunk(0, 0, 4, 0, 4, False),
        Chunk(1, 4, 8, 4, 8, False),
        Chunk(2, 8, 10, 8, 10, True),
    ]
    assert s.offered_at == [4, 8, 10]


def test_fixed_frames_boundary_close():
    s = one_by_one(FixedFrames(4), 8, close_with_last=True)
    assert s.chunks == [Chunk(0, 0, 4, 0, 4, False), Chunk(1, 4, 8, 4, 8, True)]
    s = one_by_one(FixedFrames(4), 8, close_with_last=False)
    assert s.chunks == [Chunk(0, 0, 4, 0, 4, False), Chunk(1, 4, 8, 4, 8, False)]


def test_fixed_frames_short_stream_flushes_on_close():
    p = FixedFrames(4)
    assert p.next_chunk(3, 0, 0, False) is None
    assert p.next_chunk(3, 0, 0, True) == Chunk(0, 0, 3, 0, 3, True)


def test_fixed_frames_lagging_consumer_takes_size_at_a_time():
    p = FixedFrames(4)
    assert p.next_chunk(11, 0, 0, False) == Chunk(0, 0, 4, 0, 4, False)
    assert p.next_chunk(11, 2, 8, False) is None
    assert p.next_chunk(11, 1, 4, True) == Chunk(1, 4, 8, 4, 8, False)
    assert p.next_chunk(11, 2, 8, True) == Chunk(2, 8, 11, 8, 11, True)


@pytest.mark.parametrize("size", [0, -1])
def test_fixed_frames_rejects_bad_size(size):
    with pytest.raises(ValueError, match="FixedFrames.size must be >= 1"):
        FixedFrames(size)


# --------------------------------------------------------------------------- GrowingChunks


def test_growing_chunks_sizes_grow_and_cap():
    p = GrowingChunks(first=2, growth=2.0, max_size=10)
    assert [p.size_of(i) for i in range(6)] == [2, 4, 8, 10, 10, 10]
    s = one_by_one(p, 40, close_with_last=False)
    assert [(c.keep_start, c.keep_end) for c in s.chunks] == [
        (0, 2), (2, 6), (6, 14), (14, 24), (24, 34), (34, 40),
    ]
    assert [c.last for c in s.chunks] == [False] * 5 + [True]
    assert s.offered_at == [2, 6, 14, 24, 34, 40]


def test_growing_chunks_fractional_growth_truncates():
    p = GrowingChunks(first=3, growth=1.5, max_size=16)
    assert [p.size_of(i) for i in range(7)] == [3, 4, 6, 10, 15, 16, 16]


def test_growing_chunks_constant_growth():
    p = GrowingChunks(first=5, growth=1.0)
    assert {p.size_of(i) for i in range(50)} == {5}


def test_growing_chunks_default_is_doubling():
    p = GrowingChunks(first=1)
    assert [p.size_of(i) for i in range(5)] == [1, 2, 4, 8, 16]


def test_growing_chunks_many_chunks_do_not_overflow():
    # a long stream takes thousands of capped chunks; the size must stay max_size
    p = GrowingChunks(first=1, growth=2.0, max_size=64)
    assert p.size_of(5000) == 64
    c = p.next_chunk(10**6, 5000, 500_000, False)
    assert c == Chunk(5000, 500_000, 500_064, 500_000, 500_064, False)


def test_growing_chunks_context_is_given_not_kept():
    p = GrowingChunks(first=4, growth=2.0, context=3)
    s = one_by_one(p, 20, close_with_last=True)
    assert s.chunks == [
        Chunk(0, 0, 4, 0, 4, False),
        Chunk(1, 1, 12, 4, 12, False),
        Chunk(2, 9, 20, 12, 20, True),
    ]


def test_scheduled_chunks_follow_the_codec_schedule():
    """Qwen3-Omni's: 12 frames, then 13, then 25 behind 25 of left context; ``()``: 25 from the start."""
    s = one_by_one(ScheduledChunks((12, 13), 25, context=25), 90, close_with_last=True)
    assert s.chunks == [
        Chunk(0, 0, 12, 0, 12, False),
        Chunk(1, 0, 25, 12, 25, False),
        Chunk(2, 0, 50, 25, 50, False),
        Chunk(3, 25, 75, 50, 75, False),
        Chunk(4, 50, 90, 75, 90, True),
    ]
    plain = one_by_one(ScheduledChunks((), 25, context=25), 60, close_with_last=True)
    assert [(c.start, c.keep_start, c.end) for c in plain.chunks] == [(0, 0, 25), (0, 25, 50), (25, 50, 60)]


@pytest.mark.parametrize("args", [((0,), 25), ((12,), 0), ((12,), 25, -1)])
def test_scheduled_chunks_constructor_errors(args):
    with pytest.raises(ValueError):
        ScheduledChunks(*args)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(first=0),
        dict(first=-2),
        dict(first=2, growth=0.5),
        dict(first=4, max_size=3),
        dict(first=2, context=-1),
    ],
)
def test_growing_chunks_constructor_errors(kwargs):
    with pytest.raises(ValueError, match="GrowingChunks needs"):
        GrowingChunks(**kwargs)


def test_growing_chunks_max_size_equal_first_is_fine():
    p = GrowingChunks(first=3, max_size=3)
    assert [p.size_of(i) for i in range(3)] == [3, 3, 3]


# --------------------------------------------------------------------------- SlidingWindow


def test_sliding_window_lookahead():
    assert SlidingWindow(28, 7).lookahead == 10
    assert SlidingWindow(28, 7, keep="last").lookahead == 0
    assert SlidingWindow(8, 3).lookahead == 2
    assert SlidingWindow(5, 5).lookahead == 0


def test_sliding_window_orpheus_open_stream():
    p = SlidingWindow(window=28, stride=7, keep="middle")
    s = Stream(p)
    for _ in range(49):
        s.available += 1
        s.drain()
    assert s.chunks == [
        Chunk(0, 0, 28, 0, 18, False),   # first full window keeps everything before its lookahead
        Chunk(1, 7, 35, 18, 25, False),  # then every 7 new items: 28 decoded, 7 kept
        Chunk(2, 14, 42, 25, 32, False),
        Chunk(3, 21, 49, 32, 39, False),
    ]
    assert s.offered_at == [28, 35, 42, 49]
    # nothing between strides
    assert p.next_chunk(55, 4, 39, False) is None
    assert p.next_chunk(56, 4, 39, False) == Chunk(4, 28, 56, 39, 46, False)


def test_sliding_window_orpheus_close_flushes_tail():
    p = SlidingWindow(window=28, stride=7, keep="middle")
    s = one_by_one(p, 45, close_with_last=False)
    assert s.chunks == [
        Chunk(0, 0, 28, 0, 18, False),
        Chunk(1, 7, 35, 18, 25, False),
        Chunk(2, 14, 42, 25, 32, False),
        Chunk(3, 17, 45, 32, 45, True),  # the last window keeps its look-ahead too
    ]


def test_sliding_window_orpheus_short_streams():
    p = SlidingWindow(window=28, stride=7, keep="middle")
    assert one_by_one(p, 0, True).chunks == []
    assert one_by_one(p, 1, True).chunks == [Chunk(0, 0, 1, 0, 1, True)]
    assert one_by_one(p, 20, False).chunks == [Chunk(0, 0, 20, 0, 20, True)]
    assert one_by_one(p, 27, True).chunks == [Chunk(0, 0, 27, 0, 27, True)]
    assert one_by_one(p, 28, True).chunks == [Chunk(0, 0, 28, 0, 28, True)]
    assert one_by_one(p, 28, False).chunks == [Chunk(0, 0, 28, 0, 18, False), Chunk(1, 0, 28, 18, 28, True)]
    assert one_by_one(p, 30, True).chunks == [Chunk(0, 0, 28, 0, 18, False), Chunk(1, 2, 30, 18, 30, True)]


def test_sliding_window_orpheus_closed_burst_stays_within_windows():
    p = SlidingWindow(window=28, stride=7, keep="middle")
    s = Stream(p)
    s.available, s.closed = 60, True
    s.drain()
    assert s.chunks == [
        Chunk(0, 0, 28, 0, 18, False),
        Chunk(1, 7, 35, 18, 25, False),
        Chunk(2, 14, 42, 25, 32, False),
        Chunk(3, 32, 60, 32, 60, True),
    ]


def test_sliding_window_keep_last():
    p = SlidingWindow(window=8, stride=2, keep="last")
    s = one_by_one(p, 13, close_with_last=False)
    assert s.chunks == [
        Chunk(0, 0, 8, 0, 8, False),
        Chunk(1, 2, 10, 8, 10, False),
        Chunk(2, 4, 12, 10, 12, False),
        Chunk(3, 5, 13, 12, 13, True),
    ]


def test_sliding_window_stride_equals_window_is_plain_chunking():
    p = SlidingWindow(window=5, stride=5)
    s = one_by_one(p, 12, close_with_last=True)
    spans = [(c.start, c.end, c.keep_start, c.keep_end) for c in s.chunks]
    assert spans == [(0, 5, 0, 5), (5, 10, 5, 10), (7, 12, 10, 12)]


@pytest.mark.parametrize(
    "window, stride",
    [(28, 0), (28, -1), (7, 8), (0, 0)],
)
def test_sliding_window_bad_stride(window, stride):
    with pytest.raises(ValueError, match="1 <= stride <= window"):
        SlidingWindow(window=window, stride=stride)


def test_sliding_window_bad_keep():
    with pytest.raises(ValueError, match="keep must be 'middle' or 'last'.*'first'"):
        SlidingWindow(28, 7, keep="first")


def test_chunk_policy_is_abstract():
    with pytest.raises(TypeError):
        ChunkPolicy()  # type: ignore[abstract]
