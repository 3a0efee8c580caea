"""H.264 mp4 writing with PyAV: the frame count, size and rate survive the round trip, the
pictures come back close (lossy, but at crf 18 a few levels), and bad frames are refused; a
soundtrack comes back as AAC at its rate, channels and length, in time with the pictures."""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")

from mstar.media.video import decode_mp4, decode_mp4_audio, encode_mp4  # noqa: E402


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


@pytest.mark.parametrize("channels", [1, 2])
def test_a_soundtrack_round_trips_as_aac(channels):
    t = np.arange(48000) / 48000  # one second of chirps, which no shift of the track matches
    sound = np.stack([0.4 * np.sin(2 * np.pi * (200 + 400 * t) * t), 0.3 * np.sin(2 * np.pi * (300 + 300 * t) * t)])
    sound = sound[:channels].astype(np.float32)
    data = encode_mp4(frames(25), fps=25, audio=sound, sample_rate=48000)
    video, _ = decode_mp4(data)
    back, rate = decode_mp4_audio(data)
    assert video.shape[0] == 25 and rate == 48000 and back.shape[0] == channels
    assert 48000 <= back.shape[1] < 48000 + 1024  # the last AAC frame is padded
    assert np.abs(back[:, 4096:40000] - sound[:, 4096:40000]).mean() < 0.05  # lossy but not shifted


def test_a_soundtrack_needs_one_or_two_channels():
    with pytest.raises(ValueError, match="channels"):
        encode_mp4(frames(2), audio=np.zeros((3, 100), np.float32))
