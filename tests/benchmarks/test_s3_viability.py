"""S3's streaming viability: a stream is viable when a player starting at its first audio
byte never runs dry."""

from __future__ import annotations

from benchmarks.s3_orpheus import StreamTiming

RATE = 48000  # bytes of s16le audio per second at 24 kHz


def _timing(arrivals: list[tuple[float, int]]) -> StreamTiming:
    return StreamTiming(0.0, arrivals[0][0] if arrivals else None, arrivals[-1][0] if arrivals else 0.0,
                        sum(n for _, n in arrivals), arrivals)


def test_chunks_that_arrive_before_the_audio_ahead_plays_out_are_viable() -> None:
    # 0.5 s of audio per chunk, each 0.4 s after the last: the player stays ahead.
    assert _timing([(1.0 + 0.4 * i, RATE // 2) for i in range(10)]).viable(RATE)
    # exactly on time (the next chunk lands as the last sample plays) still counts
    assert _timing([(1.0 + 0.5 * i, RATE // 2) for i in range(4)]).viable(RATE)


def test_a_late_chunk_is_an_underrun() -> None:
    chunks = [(1.0 + 0.4 * i, RATE // 2) for i in range(10)]
    chunks[6] = (chunks[5][0] + 1.2, RATE // 2)  # stalls past the 0.5 s + slack banked so far
    assert not _timing(chunks).viable(RATE)


def test_slack_banked_early_covers_a_later_stall() -> None:
    # a burst of 2 s of audio at once, then chunks slower than real time for a while
    chunks = [(1.0, 2 * RATE)] + [(1.0 + 0.7 * i, RATE // 2) for i in range(1, 4)]
    assert _timing(chunks).viable(RATE)


def test_no_audio_is_not_viable() -> None:
    assert not _timing([]).viable(RATE)
