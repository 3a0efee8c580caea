"""Encoding generated speech (mono float32 PCM chunks) into a response format.

``AudioEncoder`` takes the backend's float32 little-endian chunks as they come
(``feed``) and returns the bytes that are ready to send; ``finish`` returns the rest.

* ``wav``: PCM16 with a RIFF header. Streamed, the header comes first and declares an
  unknown length (0xFFFFFFFF, as OpenAI does); otherwise the whole file comes at the end
  with exact sizes.
* ``pcm``: raw PCM16 little-endian at the backend's rate, sent as it comes.
* ``flac`` / ``mp3``: encoded by libsndfile once all audio is in (also when streaming:
  their headers need the total length); ``mp3`` only where libsndfile can write MP3.
* ``opus`` / ``aac`` and anything else: refused with an ``AudioError`` naming
  ``response_format``.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf

from mstar.audio.io import AudioError

OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
}
_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}
_UNKNOWN_SIZE = 0xFFFFFFFF
_FIELD = "response_format"


def mp3_supported() -> bool:
    """Whether this libsndfile can write MP3 (libsndfile >= 1.1 built with LAME)."""
    return "MP3" in sf.available_formats()


def supported_formats() -> list[str]:
    """The response formats this installation can produce."""
    return [f for f in ("wav", "pcm", "flac", "mp3") if f != "mp3" or mp3_supported()]


def check_format(fmt: str) -> str:
    """``fmt`` when it can be produced here, else an ``AudioError`` naming response_format."""
    if fmt in supported_formats():
        return fmt
    choices = ", ".join(supported_formats())
    if fmt in OPENAI_FORMATS:
        reason = f"{fmt!r} is not supported by this server; use one of {choices}"
    else:
        reason = f"{fmt!r} is not a known audio format; use one of {choices}"
    raise AudioError(_FIELD, reason)


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] as PCM16 little-endian; out-of-range values are clipped,
    NaN becomes silence."""
    x = np.nan_to_num(np.asarray(samples, dtype=np.float32), nan=0.0)
    scaled = np.rint(np.clip(x, -1.0, 1.0) * 32767.0)
    return scaled.astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte RIFF/WAVE header for mono PCM16; ``None``: unknown length (streaming)."""
    if data_bytes is None:
        riff_size = data_size = _UNKNOWN_SIZE
    else:
        riff_size, data_size = 36 + data_bytes, data_bytes
    fmt_chunk = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
        + b"data" + struct.pack("<I", data_size)
    )  # fmt: skip


class AudioEncoder:
    """Turns float32 LE PCM chunks into one response format, chunk by chunk.

    ``streaming``: the response goes out as it is produced (wav then gets an
    unknown-length header up front). ``media_type`` is the response's Content-Type.
    """

    def __init__(self, fmt: str, sample_rate: int, *, streaming: bool = False) -> None:
        self.format = check_format(fmt)
        if sample_rate <= 0:
            raise ValueError(f"invalid sample rate {sample_rate}")
        self.sample_rate = int(sample_rate)
        self.streaming = streaming
        self.media_type = MEDIA_TYPES[self.format]
        self._rest = b""  # the bytes of a float32 sample split across chunks
        self._held: list[bytes] = []  # output kept back until finish()
        self._header_sent = False

    def _samples(self, chunk: bytes) -> np.ndarray:
        data = self._rest + bytes(chunk)
        whole = len(data) - len(data) % 4
        self._rest = data[whole:]
        return np.frombuffer(data[:whole], dtype="<f4")

    def feed(self, chunk: bytes) -> bytes:
        """Take one float32 LE chunk; return what can be sent now (maybe nothing)."""
        samples = self._samples(chunk)
        if self.format in _SOUNDFILE:
            self._held.append(samples.tobytes())
            return b""
        pcm = float_to_pcm16(samples)
        if self.format == "pcm":
            return pcm
        if not self.streaming:  # wav with exact sizes: wait for the end
            self._held.append(pcm)
            return b""
        return self._stream_header() + pcm

    def finish(self) -> bytes:
        """The bytes left to send once the backend is done."""
        if self._rest:  # a truncated last sample: drop it, like a decoder would
            self._rest = b""
        held = b"".join(self._held)
        self._held.clear()
        if self.format == "pcm":
            return b""
        if self.format == "wav":
            if self.streaming:
                return self._stream_header()  # only when no audio came at all
            return wav_header(self.sample_rate, len(held)) + held
        return self._soundfile(np.frombuffer(held, dtype="<f4"))

    def _stream_header(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return wav_header(self.sample_rate, None)

    def _soundfile(self, samples: np.ndarray) -> bytes:
        container, subtype = _SOUNDFILE[self.format]
        clipped = np.clip(np.nan_to_num(samples, nan=0.0), -1.0, 1.0)
        if clipped.size == 0:  # libsndfile writes no header for no frames: send 1 silent one
            clipped = np.zeros(1, dtype=np.float32)
        buf = io.BytesIO()
        sf.write(buf, clipped, self.sample_rate, format=container, subtype=subtype)
        return buf.getvalue()


def encode_audio(samples: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """A whole clip (mono float samples) as one ``fmt`` file."""
    encoder = AudioEncoder(fmt, sample_rate)
    pcm = np.asarray(samples, dtype="<f4").tobytes()
    return encoder.feed(pcm) + encoder.finish()
