"""The Realtime route's streaming resampler equals scipy's ``resample_poly`` on the whole
signal, however the signal is cut into pieces."""

from __future__ import annotations

from math import gcd

import numpy as np
import pytest
from scipy.signal import resample_poly

from mstar.server.realtime.resample import StreamResampler, float_to_pcm16, pcm16_to_float


@pytest.mark.parametrize(("src", "dst"), [(24000, 16000), (22050, 24000), (16000, 24000)])
def test_pieces_join_to_resample_poly(src: int, dst: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(6000)
    resampler = StreamResampler(src, dst)
    pieces, i = [], 0
    while i < len(x):
        n = int(rng.integers(1, 700))
        pieces.append(resampler.push(x[i:i + n]))
        i += n
    pieces.append(resampler.flush())
    g = gcd(src, dst)
    expected = resample_poly(x, dst // g, src // g)
    got = np.concatenate(pieces)
    assert len(got) == len(expected)
    # float32 output: the difference is its rounding (measured 1.2e-7)
    assert np.abs(got - expected).max() < 1e-6


def test_flush_starts_a_new_stream() -> None:
    resampler = StreamResampler(24000, 16000)
    x = np.sin(np.arange(2400) / 10.0)
    first = np.concatenate([resampler.push(x), resampler.flush()])
    second = np.concatenate([resampler.push(x), resampler.flush()])
    np.testing.assert_array_equal(first, second)


def test_pcm16_round_trip() -> None:
    samples = np.array([-1.0, -0.5, 0.0, 0.25, 0.999, 2.0], np.float32)
    back = pcm16_to_float(float_to_pcm16(samples))
    np.testing.assert_allclose(back[:5], samples[:5], atol=2 / 32768)  # scaled by 32767 out, 32768 back
    assert back[5] == pytest.approx(32767 / 32768)  # clipped
