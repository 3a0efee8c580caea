"""The reference's window policy (whole clip up to 20 s; longer: the fewest windows of at
most 16 s, about equal, each cut at the quietest 0.1 s within 5 s of its boundary), the
utterance normalisation, and how the CTC node packs a step's clips into forwards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mstar.model.omniasr.engine import pack
from mstar.model.omniasr.modeling import normalize_utterance
from mstar.model.omniasr.windows import cut_windows

RATE = 16000


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal(int(seconds * RATE))).astype(np.float32)


def test_up_to_twenty_seconds_is_whole():
    assert cut_windows(noise(20.0), RATE) == [(0, 20 * RATE)]
    assert cut_windows(noise(3.0), RATE) == [(0, 3 * RATE)]
    assert cut_windows(np.zeros(0, np.float32), RATE) == []


@pytest.mark.parametrize("seconds", [20.01, 31.0, 32.0, 47.5, 95.3, 600.0])
def test_longer_is_the_fewest_near_equal_windows_within_sixteen_seconds(seconds):
    audio = noise(seconds, seed=int(seconds))
    windows = cut_windows(audio, RATE)
    n = len(audio)
    assert len(windows) == math.ceil(n / (16 * RATE))
    assert windows[0][0] == 0 and windows[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    ideal = n / len(windows)
    for i, (start, end) in enumerate(windows):
        assert 0 < end - start <= 16 * RATE
        if i:
            assert abs(start - round(i * ideal)) <= 5 * RATE


def test_each_cut_is_at_the_quietest_tenth_of_a_second():
    """24 s of noise with a 0.2 s pause at 9.0 s and a quieter 0.1 s stretch at 14.5 s: the one
    boundary (12 s) moves to the quietest stretch within reach (8 to 16 s), the middle of the
    0.1 s one; without it, into the pause."""
    audio = noise(24.0, seed=3)
    audio[9 * RATE:int(9.2 * RATE)] *= 0.01
    audio[int(14.5 * RATE):int(14.6 * RATE)] = 0.0
    (first, second) = cut_windows(audio, RATE)
    assert first[1] == int(14.55 * RATE) == second[0]
    audio[int(14.5 * RATE):int(14.6 * RATE)] = noise(0.1, seed=9)
    assert cut_windows(audio, RATE)[0][1] in range(9 * RATE, int(9.2 * RATE) + 1)


def test_a_quiet_point_past_sixteen_seconds_is_not_taken():
    """26 s: two windows of at most 16 s, so the cut lies in 10 to 16 s; silence at 17 s is
    out of reach."""
    audio = noise(26.0, seed=4)
    audio[int(17.0 * RATE):int(17.3 * RATE)] = 0.0
    windows = cut_windows(audio, RATE)
    assert all(end - start <= 16 * RATE for start, end in windows)
    assert windows[0][1] <= 16 * RATE


def test_window_lengths_are_parameters():
    windows = cut_windows(noise(50.0), RATE, whole_s=40.0, window_s=40.0)
    assert len(windows) == 2 and all(b - a <= 40 * RATE for a, b in windows)
    assert cut_windows(noise(39.0), RATE, whole_s=40.0, window_s=40.0) == [(0, 39 * RATE)]


def test_utterance_normalisation_is_zero_mean_unit_variance():
    x = torch.from_numpy(noise(1.0)) * 3 + 0.7
    y = normalize_utterance(x)
    assert abs(float(y.mean())) < 1e-6
    assert float(y.var(unbiased=False)) == pytest.approx(float(x.var(unbiased=False)) /
                                                          (float(x.var(unbiased=False)) + 1e-5), rel=1e-5)
    assert normalize_utterance(torch.zeros(800)).abs().max() == 0  # silence stays finite


def test_pack_sorts_by_length_under_the_budget():
    lengths = [10, 50, 30, 40, 20, 45]
    groups = pack(lengths, max_rows=16, max_samples=100)
    assert groups == [[1, 5], [3, 2], [4, 0]]  # 2*50, 2*40 (3*40 > 100), then 2*20
    assert pack(lengths, max_rows=1, max_samples=10**6) == [[1], [5], [3], [2], [4], [0]]
    assert pack([500, 10], max_rows=4, max_samples=100) == [[0], [1]]  # a long clip runs alone
    assert sorted(i for g in pack(lengths, max_rows=3, max_samples=10**6) for i in g) == list(range(6))
