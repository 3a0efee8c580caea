"""Where a long upload is cut: the reference's window policy for the CTC models.

A clip of at most ``whole_s`` (20 s) is transcribed whole. A longer one is cut into the fewest
windows of at most ``window_s`` (16 s), of about equal length: the ``k - 1`` ideal boundaries
sit at ``i * n / k``, and each cut moves to the middle of the quietest ``quiet_s`` (0.1 s)
stretch within ``search_s`` (5 s) of its boundary, kept where every window stays within
``window_s`` (the cut is at most ``window_s`` after the previous one, and what is left still
fits the windows left).

The CTC model reads a window at once and emits no timestamps, so the windows' texts are
simply joined; equal lengths keep every window well inside what the model was trained on,
where cutting at the limit would leave a short, context-poor tail.
"""

from __future__ import annotations

import math

import numpy as np


def quiet_cut(samples: np.ndarray, lo: int, hi: int, span: int) -> int:
    """The middle of the quietest ``span`` samples (least energy) whose middle lies in
    ``[lo, hi]``. Equally quiet spans in a row (a pause longer than a span, digital silence)
    give the middle of the first such run. Where no whole span fits, the middle of the range."""
    half = span // 2
    first = max(lo - half, 0)
    last = min(hi - half, len(samples) - span)
    if last < first:
        return (lo + hi) // 2
    piece = np.square(samples[first:last + span], dtype=np.float64)
    sums = np.concatenate(([0.0], np.cumsum(piece)))
    energy = sums[span:] - sums[:-span]  # energy[j]: the span starting at first + j
    best = int(np.argmin(energy))
    quiet = energy <= energy[best] * (1 + 1e-6) + 1e-12
    run_end = best + int(np.argmin(quiet[best:])) if not quiet[best:].all() else len(quiet)
    return int(min(max(first + (best + run_end - 1) // 2 + half, lo), hi))


def cut_windows(samples: np.ndarray, rate: int, *, whole_s: float = 20.0, window_s: float = 16.0,
                search_s: float = 5.0, quiet_s: float = 0.1) -> list[tuple[int, int]]:
    """``(start, end)`` sample ranges tiling ``samples`` (mono), per the policy above."""
    n = int(len(samples))
    if n == 0:
        return []
    if n <= int(whole_s * rate):
        return [(0, n)]
    max_len = max(int(window_s * rate), 1)
    count = math.ceil(n / max_len)
    search, span = int(search_s * rate), max(int(quiet_s * rate), 1)
    cuts, previous = [], 0
    for i in range(1, count):
        ideal = round(i * n / count)
        lo = max(ideal - search, previous + 1, n - (count - i) * max_len)
        hi = min(ideal + search, previous + max_len)
        previous = quiet_cut(samples, lo, hi, span)
        cuts.append(previous)
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))
