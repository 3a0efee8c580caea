"""Reference clips for voice cloning: decoded to mono float32 at the clip's own rate, stereo
averaged, and every bad clip (empty, not audio, undecodable, over 60 s, below 8 kHz, more
than two channels, non-finite) refused with an ``AudioError`` naming ``ref_audio``."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from mstar.audio.io import AudioError
from mstar.audio.reference import MAX_SECONDS, clip_samples, decode_reference


def wav(samples: np.ndarray, rate: int, subtype: str = "FLOAT", fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return mono if channels == 1 else np.stack([mono * (c + 1) / channels for c in range(channels)], axis=1)


def refused(data: bytes, needle: str) -> AudioError:
    with pytest.raises(AudioError) as err:
        decode_reference(data)
    assert err.value.field == "ref_audio" and needle in err.value.message, err.value.message
    return err.value


def test_a_clip_keeps_its_rate_and_samples():
    samples = tone(0.5, 22050)
    clip = decode_reference(wav(samples, 22050), text=" hello ")
    assert clip.sample_rate == 22050 and clip.text == " hello "
    assert np.array_equal(clip_samples(clip), samples) and clip.duration == pytest.approx(0.5)


def test_stereo_is_averaged_and_flac_decodes_the_same():
    stereo = tone(0.25, 16000, channels=2)
    clip = decode_reference(wav(stereo, 16000))
    assert np.allclose(clip_samples(clip), stereo.mean(axis=1), atol=1e-7)
    flac = decode_reference(wav(stereo, 16000, "PCM_16", "FLAC"))
    assert np.abs(clip_samples(flac) - clip_samples(clip)).max() < 2 / 32768


def test_bad_clips_are_refused_naming_ref_audio():
    refused(b"", "empty")
    refused(b"\x89PNG\r\n\x1a\n" + bytes(64), "PNG image")
    refused(b"RIFF\x00\x00\x00\x00WAVEnot really", "could not decode")
    refused(wav(tone(0.1, 6000), 6000), "6000 Hz")
    refused(wav(tone(0.1, 16000, channels=3), 16000), "3 channels")
    refused(wav(np.zeros(0, np.float32), 16000), "no samples")
    refused(wav(np.full(100, np.nan, np.float32), 16000), "non-finite")


def test_a_clip_over_a_minute_is_refused_from_its_header():
    rate = 8000
    long = wav(np.zeros(int((MAX_SECONDS + 1) * rate), np.int16), rate, "PCM_16")
    refused(long, "61.0 s; the limit is 60 s")
    assert decode_reference(wav(np.zeros(int(MAX_SECONDS * rate), np.int16), rate, "PCM_16")).duration == MAX_SECONDS


def test_the_byte_cap_is_a_413():
    with pytest.raises(AudioError) as err:
        decode_reference(wav(tone(1.0, 16000), 16000), max_bytes=1000)
    assert err.value.status == 413 and err.value.field == "ref_audio"
