"""decode_audio: formats, mono mixing, resampling, and every refusal; encode_wav."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mstar.audio.io import Audio, AudioError, decode_audio, encode_wav

LIMITS = {"max_bytes": 10_000_000, "max_seconds": 60.0}
SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"


def _sine(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[np.argmax(spectrum)])


def _error(data: bytes, **limits: float) -> AudioError:
    with pytest.raises(AudioError) as info:
        decode_audio(data, **{**LIMITS, **limits})  # type: ignore[arg-type]
    assert info.value.field == "file" and isinstance(info.value, ValueError)
    return info.value


# ---------------------------------------------------------------------- decoding


@pytest.mark.parametrize(
    ("fmt", "subtype"),
    [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")],
)
def test_decodes_each_format(fmt: str, subtype: str | None) -> None:
    data = _encode(_sine(440, 16000, 1.0), 16000, fmt, subtype)
    audio = decode_audio(data, **LIMITS)
    assert isinstance(audio, Audio) and audio.sample_rate == 16000
    assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert abs(audio.duration - 1.0) < 0.1  # lossy codecs pad a little
    assert abs(len(audio.samples) - 16000) < 1600
    assert abs(_peak_hz(audio.samples, 16000) - 440) < 5


def test_stereo_is_averaged_to_mono() -> None:
    left, right = _sine(300, 16000, 0.5, 0.6), _sine(700, 16000, 0.5, 0.2)
    data = _encode(np.stack([left, right], axis=1), 16000, "WAV", "FLOAT")
    audio = decode_audio(data, **LIMITS)
    np.testing.assert_allclose(audio.samples, (left + right) / 2, atol=1e-6)


@pytest.mark.parametrize("rate", [44100, 8000, 22050, 48000])
def test_resampled_to_16k(rate: int) -> None:
    data = _encode(_sine(1000, rate, 2.0), rate, "WAV", "PCM_16")
    audio = decode_audio(data, **LIMITS)
    assert audio.sample_rate == 16000 and len(audio.samples) == 32000
    assert audio.duration == pytest.approx(2.0)
    assert abs(_peak_hz(audio.samples, 16000) - 1000) < 2
    middle = audio.samples[1000:-1000]  # away from the filter's edges
    assert np.abs(middle).max() == pytest.approx(0.5, abs=0.02)


def test_other_target_rate() -> None:
    data = _encode(_sine(440, 16000, 1.0), 16000, "WAV")
    audio = decode_audio(data, **LIMITS, target_rate=8000)
    assert audio.sample_rate == 8000 and len(audio.samples) == 8000


def test_speech_clip_decodes() -> None:
    audio = decode_audio(SPEECH.read_bytes(), **LIMITS)
    assert 8.0 <= audio.duration <= 9.5 and audio.sample_rate == 16000
    assert SPEECH.stat().st_size < 300_000
    assert np.abs(audio.samples).max() > 0.3  # not silence


# ---------------------------------------------------------------------- refusals


def test_empty_file() -> None:
    assert _error(b"").message == "file is empty"


def test_too_large_checked_before_decoding() -> None:
    err = _error(b"\x00" * 101, max_bytes=100)  # garbage: never decoded
    assert err.message == "upload is 101 bytes; the limit is 100 bytes" and err.status == 413


def test_too_long() -> None:
    data = _encode(_sine(440, 8000, 3.0), 8000, "WAV")
    err = _error(data, max_seconds=2.5)
    assert err.message == "audio is 3.0 s; the limit is 2.5 s" and err.status == 400


def test_corrupt() -> None:
    err = _error(b"this is not audio at all, just some text" * 10)
    assert err.message.startswith("could not decode audio: ")
    truncated = _encode(_sine(440, 16000, 1.0), 16000, "FLAC")[:60]
    assert _error(truncated).message.startswith("could not decode audio: ")


def _mp4_header() -> bytes:
    """The start of a tiny MP4 video: an 'ftyp' box, then the start of a 'moov' box."""
    ftyp = b"ftypisom" + b"\x00\x00\x02\x00" + b"isomiso2avc1mp41"
    moov = b"moov" + b"\x00" * 100
    return len(ftyp + b"1234").to_bytes(4, "big") + ftyp + (len(moov) + 4).to_bytes(4, "big") + moov


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        (_mp4_header(), "MP4/MOV (isom)"),
        (b"\x00\x00\x00\x14ftypqt  \x00\x00\x02\x00qt  " + b"\x00" * 64, "MP4/MOV (qt)"),
        (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01" + b"\x00" * 64 + b"webm", "Matroska/WebM"),
        (b"RIFF\x00\x10\x00\x00AVI LIST" + b"\x00" * 64, "AVI"),
    ],
)
def test_video_containers_are_named(head: bytes, kind: str) -> None:
    message = _error(head).message
    assert kind in message and "video container, not audio" in message


def test_other_non_audio_is_named() -> None:
    assert "PNG image, not audio" in _error(b"\x89PNG\r\n\x1a\n" + b"\x00" * 50).message
    m4a = b"\x00\x00\x00\x18ftypM4A \x00\x00\x00\x00M4A isom" + b"\x00" * 40
    assert "M4A/AAC audio" in _error(m4a).message


def test_zero_length_audio() -> None:
    data = _encode(np.zeros(0, dtype=np.float32), 16000, "WAV")
    assert "zero length" in _error(data).message


def test_non_finite_samples() -> None:
    samples = _sine(440, 16000, 0.1)
    samples[10] = np.nan
    data = _encode(samples, 16000, "WAV", "FLOAT")
    assert "non-finite samples" in _error(data).message


# ---------------------------------------------------------------------- encoding


def test_encode_wav_round_trip() -> None:
    samples = _sine(440, 16000, 0.25)
    data = encode_wav(samples, 16000)
    info = sf.info(io.BytesIO(data))
    assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
    back, _ = sf.read(io.BytesIO(data), dtype="float32")
    np.testing.assert_allclose(back, samples, atol=1 / 32767)
    clipped, _ = sf.read(io.BytesIO(encode_wav(np.array([2.0, -2.0]), 8000)), dtype="float32")
    np.testing.assert_allclose(clipped, [1.0, -1.0], atol=1e-4)
