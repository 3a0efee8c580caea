"""split_at_quiet_points: exact tiling, window limits, and cuts placed in pauses."""

from __future__ import annotations

import numpy as np
import pytest

from mstar.audio.windows import split_at_quiet_points

RATE = 16000


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, int(seconds * RATE)).astype(np.float32)


def _assert_tiles(windows: list[tuple[int, int]], n: int, max_len: int) -> None:
    assert windows[0][0] == 0 and windows[-1][1] == n
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert end == start  # no gaps, no overlaps
    assert all(0 < end - start <= max_len for start, end in windows)


def test_short_audio_is_one_window() -> None:
    assert split_at_quiet_points(_noise(12.0), RATE) == [(0, 12 * RATE)]
    assert split_at_quiet_points(_noise(30.0), RATE) == [(0, 30 * RATE)]
    assert split_at_quiet_points(np.zeros(0, dtype=np.float32), RATE) == []


@pytest.mark.parametrize("seconds", [30.01, 61.0, 95.5, 240.0])
def test_windows_tile_exactly(seconds: float) -> None:
    audio = _noise(seconds)
    windows = split_at_quiet_points(audio, RATE)
    _assert_tiles(windows, len(audio), 30 * RATE)
    # every cut falls in the search span: the last 5 s before its window's limit
    assert all(end - start >= 25 * RATE for start, end in windows[:-1])


def test_cuts_in_inserted_silent_gaps() -> None:
    audio = _noise(70.0)
    gaps = [(27.0, 27.4), (54.0, 54.6)]
    for lo, hi in gaps:
        audio[int(lo * RATE) : int(hi * RATE)] = 0.0
    windows = split_at_quiet_points(audio, RATE)
    _assert_tiles(windows, len(audio), 30 * RATE)
    cuts = [end / RATE for _, end in windows[:-1]]
    assert len(cuts) == len(gaps)
    for cut, (lo, hi) in zip(cuts, gaps):
        assert lo < cut < hi
        assert cut == pytest.approx((lo + hi) / 2, abs=0.02)  # the middle of the pause


def test_quietest_not_silent_point_wins() -> None:
    audio = _noise(40.0)
    audio[int(28.0 * RATE) : int(28.1 * RATE)] *= 0.01  # a soft stretch, not silence
    audio[int(26.0 * RATE) : int(26.1 * RATE)] *= 0.1  # softer than speech, louder than 28 s
    (_, cut), _ = split_at_quiet_points(audio, RATE)
    assert 28.0 < cut / RATE < 28.1


def test_gap_outside_search_span_is_ignored() -> None:
    audio = _noise(45.0)
    audio[int(10 * RATE) : int(11 * RATE)] = 0.0  # before the last 5 s of the window
    (_, cut), _ = split_at_quiet_points(audio, RATE)
    assert 25 * RATE <= cut <= 30 * RATE


def test_parameters_and_stereo() -> None:
    audio = np.stack([_noise(25.0, 1), _noise(25.0, 2)], axis=1)
    audio[int(9.5 * RATE) : int(9.7 * RATE)] = 0.0
    windows = split_at_quiet_points(audio, RATE, max_window_s=10.0, search_s=2.0)
    _assert_tiles(windows, len(audio), 10 * RATE)
    assert 9.5 < windows[0][1] / RATE < 9.7
    blind = split_at_quiet_points(_noise(25.0), RATE, max_window_s=10.0, search_s=0.0)
    assert blind == [(0, 160000), (160000, 320000), (320000, 400000)]
    with pytest.raises(ValueError):
        split_at_quiet_points(audio, 0)
