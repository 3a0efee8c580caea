"""Decoding uploaded audio into 16 kHz mono float32 samples, and encoding WAV.

``decode_audio`` is the one entry point for untrusted uploads: it checks the size before
decoding, recognises common non-audio files (video containers, images, archives) by
their signatures, checks the duration from the header before reading the samples, and
reports every problem as an ``AudioError`` naming the request field (``file``).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from math import gcd

import numpy as np
import soundfile as sf

SUPPORTED = "WAV, FLAC, OGG or MP3"


class AudioError(ValueError):
    """An unusable upload; ``status`` is the HTTP status it deserves (413: too large)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Audio:
    """Decoded audio: ``samples`` is mono float32 at ``sample_rate``; ``duration`` in s."""

    samples: np.ndarray
    sample_rate: int
    duration: float


# ------------------------------------------------------------------ sniffing

_VIDEO = "a video container, not audio"
_MP4_AUDIO_BRANDS = {b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B "}


def sniff_non_audio(head: bytes) -> str | None:
    """What the file is when its first bytes say it is not decodable audio, else None."""
    if head[4:8] == b"ftyp":
        if head[8:12] in _MP4_AUDIO_BRANDS:
            return "M4A/AAC audio (an MP4 container), which is not supported"
        brand = head[8:12].decode("ascii", "replace").strip() or "?"
        return f"an MP4/MOV ({brand}) file, {_VIDEO}"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return f"a Matroska/WebM file, {_VIDEO}"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return f"an AVI file, {_VIDEO}"
    if head.startswith(b"FLV\x01"):
        return f"an FLV file, {_VIDEO}"
    if head.startswith(b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"):
        return f"an ASF/WMV file, {_VIDEO}"
    if head.startswith(b"\x00\x00\x01\xba") or head.startswith(b"\x00\x00\x01\xb3"):
        return f"an MPEG program stream, {_VIDEO}"
    if len(head) >= 189 and head[0] == 0x47 and head[188] == 0x47:
        return f"an MPEG transport stream, {_VIDEO}"
    for magic, kind in (
        (b"\x89PNG\r\n\x1a\n", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"GIF8", "a GIF image"),
        (b"%PDF", "a PDF document"),
        (b"PK\x03\x04", "a ZIP archive"),
    ):
        if head.startswith(magic):
            return f"{kind}, not audio"
    return None


# ------------------------------------------------------------------ decoding


def read_frames(data: bytes, max_seconds: float, field: str = "file",
          check_header: Callable[[sf.SoundFile], None] | None = None) -> tuple[np.ndarray, int]:
    """All frames as float32 ``(frames, channels)`` and the rate; the duration (and whatever
    ``check_header`` checks) is checked from the header first, so an over-long file is refused
    without decoding it."""
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate = int(f.samplerate)
            if rate <= 0:
                raise AudioError(field, f"invalid sample rate {rate}")
            if check_header is not None:
                check_header(f)
            if f.frames > 0:
                _check_duration(f.frames / rate, max_seconds, field)
            frames = f.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except Exception as exc:  # libsndfile reports corrupt/unknown data in several ways
        reason = str(exc).strip() or type(exc).__name__
        raise AudioError(field, f"could not decode audio: {reason} (send {SUPPORTED})") from None
    return frames, rate


def _check_duration(seconds: float, max_seconds: float, field: str = "file") -> None:
    if seconds > max_seconds:
        raise AudioError(field, f"audio is {seconds:.1f} s; the limit is {max_seconds:g} s")


def resample(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """``samples`` (1-D) from ``rate`` to ``target_rate`` with a polyphase filter."""
    if rate == target_rate:
        return samples.astype(np.float32, copy=False)
    g = gcd(rate, target_rate)
    from scipy.signal import resample_poly  # imported when first needed: scipy is large

    out = resample_poly(samples, target_rate // g, rate // g)
    return out.astype(np.float32, copy=False)


def decode_audio(
    data: bytes, *, max_bytes: int, max_seconds: float, target_rate: int = 16000
) -> Audio:
    """Decode an uploaded WAV/FLAC/OGG/MP3 file to mono float32 at ``target_rate``.

    Raises ``AudioError`` (field ``file``) for an empty, oversized (status 413), corrupt,
    non-audio (e.g. video container), zero-length, over-long or non-finite upload.
    """
    if len(data) > max_bytes:
        message = f"upload is {len(data)} bytes; the limit is {max_bytes} bytes"
        raise AudioError("file", message, 413)
    if not data:
        raise AudioError("file", "file is empty")
    what = sniff_non_audio(bytes(data[:256]))
    if what is not None:
        raise AudioError("file", f"the file is {what}; send {SUPPORTED} audio")
    frames, rate = read_frames(data, max_seconds)
    if frames.shape[0] == 0 or frames.shape[1] == 0:
        raise AudioError("file", "the audio has zero length (no samples)")
    _check_duration(frames.shape[0] / rate, max_seconds)
    if not np.isfinite(frames).all():
        raise AudioError("file", "the audio contains non-finite samples (NaN or infinity)")
    mono = frames.mean(axis=1, dtype=np.float32)
    samples = resample(mono, rate, target_rate)
    return Audio(samples=samples, sample_rate=target_rate, duration=frames.shape[0] / rate)


def encode_wav(samples: np.ndarray, rate: int) -> bytes:
    """``samples`` (``(frames,)`` or ``(frames, channels)``, floats in [-1, 1]) as PCM16 WAV."""
    buf = io.BytesIO()
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    sf.write(buf, clipped, int(rate), format="WAV", subtype="PCM_16")
    return buf.getvalue()
