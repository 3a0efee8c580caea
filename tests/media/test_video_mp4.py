"""H.264 mp4 writing with PyAV: the frame count, size and rate survive the round trip, the
pictures come back close (lossy, but at crf 18 a few levels), and bad frames are refused."""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")

from mstar.media.video import decode_mp4, encode_mp4  # noqa: E402


def frames(count: int = 9, height: int = 32, width: int = 64) -> np.ndarray:
    """Smooth moving gradients (what a codec is built for), different in every frame."""
    y, x = np.mgrid[0:height, 0:width]
    video = [np.stack([(x * 4 + 8 * i) % 256, (y * 6 + 5 * i) % 256, np.full_like(x, 30 * i % 256)], axis=-1)
             for i in range(count)]
    return np.asarray(video, dtype=np.uint8)


@pytest.mark.parametrize("count, fps", [(1, 24), (9, 24), (17, 16)])
def test_round_trip(count, fps):
    video = frames(count)
    data = encode_mp4(video, fps=fps)
    assert data[4:8] == b"ftyp"
    assert data.find(b"moov") < data.find(b"mdat")  # faststart: the index first
    decoded, rate = decode_mp4(data)
    assert decoded.shape == video.shape
    assert rate == fps
    err = np.abs(decoded.astype(np.int16) - video.astype(np.int16)).mean()
    print(f"[mp4] {count} frames: mean abs error {err:.2f} levels, {len(data)} bytes")
    assert err < 6


@pytest.mark.parametrize("bad", [np.zeros((0, 32, 32, 3), np.uint8), np.zeros((2, 32, 32, 3), np.float32),
                                 np.zeros((2, 31, 32, 3), np.uint8), np.zeros((2, 32, 32), np.uint8)])
def test_bad_frames_are_refused(bad):
    with pytest.raises(ValueError):
        encode_mp4(bad)
