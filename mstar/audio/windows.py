"""Cutting long audio into model-sized windows at quiet points.

Speech models such as Whisper read at most 30 s at a time. Cutting blindly every 30 s
splits words; instead each cut goes to the quietest short stretch (lowest RMS energy
over ~20 ms) in the last few seconds before the limit, i.e. most likely a pause.
"""

from __future__ import annotations

import numpy as np

FRAME_S = 0.02  # the span over which energy is measured


def _quietest_cut(energy_of: np.ndarray, lo: int, hi: int, frame: int) -> int:
    """The cut in ``[lo, hi]`` at the middle of the quietest stretch of ``energy_of``
    (per-sample squared amplitudes): the centre of the run of equally quiet frames."""
    half = frame // 2
    first, last = max(lo - half, 0), min(hi - half, len(energy_of) - frame)
    if last < first:  # not even one whole frame fits: cut at the limit
        return hi
    window = energy_of[first : last + frame]
    sums = np.concatenate(([0.0], np.cumsum(window, dtype=np.float64)))
    means = (sums[frame:] - sums[:-frame]) / frame  # means[i]: frame starting at first+i
    best = int(np.argmin(means))
    quiet = means <= means[best] * (1 + 1e-6) + 1e-12
    # Several stretches can be equally quiet (digital silence: a stop closure inside a
    # word as well as a real pause); the longest run of them is the pause.
    edges = np.flatnonzero(np.diff(np.concatenate(([0], quiet.astype(np.int8), [0]))))
    starts, ends = edges[0::2], edges[1::2]  # run i: frames starts[i] .. ends[i] - 1
    longest = int(np.argmax(ends - starts))
    left, right = int(starts[longest]), int(ends[longest]) - 1
    cut = first + (left + right) // 2 + half
    return min(max(cut, lo), hi)


def split_at_quiet_points(
    samples: np.ndarray, rate: int, max_window_s: float = 30.0, search_s: float = 5.0
) -> list[tuple[int, int]]:
    """``(start, end)`` sample ranges that tile ``samples`` exactly, each at most
    ``max_window_s`` long; every cut is at the quietest point of the ``search_s`` seconds
    before that window's limit. Audio no longer than ``max_window_s`` is one window;
    empty audio has none. ``samples`` is ``(frames,)`` or ``(frames, channels)``."""
    if rate <= 0 or max_window_s <= 0 or search_s < 0:
        raise ValueError("rate and max_window_s must be positive, search_s non-negative")
    x = np.asarray(samples)
    n = int(x.shape[0])
    max_len = max(int(max_window_s * rate), 1)
    if n == 0:
        return []
    if n <= max_len:
        return [(0, n)]
    power = np.square(x, dtype=np.float64)
    if power.ndim > 1:
        power = power.reshape(n, -1).mean(axis=1)
    frame = max(int(FRAME_S * rate), 1)
    search = int(search_s * rate)
    windows: list[tuple[int, int]] = []
    start = 0
    while n - start > max_len:
        limit = start + max_len
        lo = max(limit - search, start + 1)
        cut = _quietest_cut(power, lo, limit, frame) if search else limit
        windows.append((start, cut))
        start = cut
    windows.append((start, n))
    return windows
