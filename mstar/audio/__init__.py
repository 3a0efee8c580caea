"""Audio for speech models: decoding uploads, windowing long audio, response formats."""

from mstar.audio.formats import (
    RESPONSE_FORMATS,
    language_code,
    language_name,
    render_transcription,
)
from mstar.audio.io import Audio, AudioError, decode_audio, encode_wav
from mstar.audio.windows import split_at_quiet_points

__all__ = [
    "RESPONSE_FORMATS",
    "Audio",
    "AudioError",
    "decode_audio",
    "encode_wav",
    "language_code",
    "language_name",
    "render_transcription",
    "split_at_quiet_points",
]
