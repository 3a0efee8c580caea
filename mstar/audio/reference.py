"""Reference clips for voice cloning: the ``ref_audio`` of a speech request, decoded once by
the API server into a ``VoiceClip`` (mono float32 at the clip's own rate) or refused with a
400 naming the field.

Refused: an empty file, one that is not audio (a video container, an image: recognised by its
signature) or that libsndfile cannot decode, a clip over ``MAX_SECONDS`` (checked from the
header, before the samples are read), one sampled below ``MIN_RATE`` (too little bandwidth
for a speaker encoder: the families read 16 kHz and up), one with more than two channels (a
multichannel recording is not one voice), and one whose samples are not all finite. Stereo
is averaged to mono. The clip keeps its sample rate: each family resamples to what its
encoders read, so one decoded clip serves every family.
"""

from __future__ import annotations

import numpy as np
import soundfile as sf

from mstar.audio.io import SUPPORTED, AudioError, read_frames, sniff_non_audio
from mstar.contract import VoiceClip

__all__ = ["MAX_BYTES", "MAX_CHANNELS", "MAX_SECONDS", "MIN_RATE", "clip_samples", "decode_reference"]

MAX_SECONDS = 60.0
MIN_RATE = 8000
MAX_CHANNELS = 2
MAX_BYTES = 32 * 1024 * 1024  # 60 s of 48 kHz stereo float32 is 23 MB


def _header_rules(field: str):
    def check(f: sf.SoundFile) -> None:
        if f.samplerate < MIN_RATE:
            raise AudioError(field, f"the clip is sampled at {f.samplerate} Hz; the lowest rate taken is {MIN_RATE} Hz")
        if f.channels > MAX_CHANNELS:
            raise AudioError(field, f"the clip has {f.channels} channels; send mono or stereo")

    return check


def decode_reference(data: bytes, *, text: str | None = None, field: str = "ref_audio",
                     max_bytes: int = MAX_BYTES) -> VoiceClip:
    """``data`` (a WAV, FLAC, OGG or MP3 file) as a checked ``VoiceClip`` with transcript
    ``text``; an ``AudioError`` naming ``field`` otherwise (see the module doc)."""
    if not data:
        raise AudioError(field, "the clip is empty")
    if len(data) > max_bytes:
        raise AudioError(field, f"the clip is {len(data)} bytes; the limit is {max_bytes} bytes", 413)
    what = sniff_non_audio(bytes(data[:256]))
    if what is not None:
        raise AudioError(field, f"the file is {what}; send {SUPPORTED} audio")
    frames, rate = read_frames(data, MAX_SECONDS, field, _header_rules(field))
    if frames.shape[0] == 0:
        raise AudioError(field, "the clip has no samples")
    if frames.shape[0] / rate > MAX_SECONDS:  # a header that did not say its length
        raise AudioError(field, f"the clip is {frames.shape[0] / rate:.1f} s; the limit is {MAX_SECONDS:g} s")
    if not np.isfinite(frames).all():
        raise AudioError(field, "the clip contains non-finite samples (NaN or infinity)")
    mono = frames.mean(axis=1, dtype=np.float32)
    return VoiceClip(pcm=mono.astype("<f4").tobytes(), sample_rate=rate, text=text)


def clip_samples(clip: VoiceClip) -> np.ndarray:
    """The clip's samples, float32 mono (a read-only view of its bytes)."""
    return np.frombuffer(clip.pcm, dtype="<f4")
