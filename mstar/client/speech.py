"""Text to speech for ``MStarClient``: the ``tts`` / ``voices`` methods (a mixin) and
their results, ``SpeechResult`` (a whole clip) and ``SpeechStream`` (bytes as they come).

    >>> client.tts("Hello there.").to_wav("hello.wav")
    >>> with client.tts("A longer story.", stream=True) as stream:
    ...     for chunk in stream: player.feed(chunk)
    >>> client.tts("Said in your voice.", reference_audio="me.wav", ref_text="What me.wav says.")
"""

from __future__ import annotations

import base64
import io
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import httpx
import numpy as np

from mstar.client.errors import MStarError

_PCM_RATE = 24000  # OpenAI's documented rate for "pcm", when the server does not say
_UNKNOWN_SIZE = 0xFFFFFFFF


def _wav_header(sample_rate: int, data_bytes: int) -> bytes:
    """A RIFF/WAVE header for mono PCM16 data of ``data_bytes``."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    riff = b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE"
    return riff + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data_bytes)


def _float_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """``samples`` (``(frames,)`` or ``(frames, channels)``) as an IEEE-float32 WAV file."""
    frames = np.asarray(samples, dtype="<f4")
    frames = frames[:, None] if frames.ndim == 1 else frames
    channels = frames.shape[1]
    data = np.ascontiguousarray(frames).tobytes()
    fmt = struct.pack("<HHIIHH", 3, channels, sample_rate, sample_rate * 4 * channels, 4 * channels, 32)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", len(data)) + data)


def reference_field(audio: str | PathLike | bytes | np.ndarray, sample_rate: int | None = None) -> str:
    """The ``ref_audio`` value for ``audio``: a data URI of its bytes, or a URL as it is."""
    if isinstance(audio, str) and audio.startswith(("data:", "http://", "https://")):
        return audio
    if isinstance(audio, np.ndarray):
        if not sample_rate:
            raise ValueError("reference_audio as samples needs reference_sample_rate")
        data = _float_wav(audio, sample_rate)
    elif isinstance(audio, (bytes, bytearray, memoryview)):
        data = bytes(audio)
    else:
        data = Path(audio).read_bytes()
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


def _fix_wav_sizes(wav: bytes) -> bytes:
    """A WAV whose RIFF and data sizes match its length (a streamed WAV declares an
    unknown length, 0xFFFFFFFF, which not every reader accepts)."""
    if wav[:4] != b"RIFF" or wav[8:12] != b"WAVE":
        raise ValueError("not a WAV file")
    out = bytearray(wav)
    pos = 12
    while pos + 8 <= len(out):
        size = struct.unpack_from("<I", out, pos + 4)[0]
        if out[pos : pos + 4] == b"data":
            if size == _UNKNOWN_SIZE or pos + 8 + size > len(out):
                struct.pack_into("<I", out, pos + 4, len(out) - pos - 8)
            break
        pos += 8 + size + (size & 1)
    struct.pack_into("<I", out, 4, len(out) - 8)
    return bytes(out)


@dataclass
class SpeechResult:
    """A synthesized clip: ``audio`` is the file's bytes in ``format`` (raw PCM16 for
    "pcm"); ``sample_rate`` is what the server reported (None: unknown)."""

    audio: bytes
    format: str
    sample_rate: int | None = None

    def wav_bytes(self) -> bytes:
        """The clip as a WAV file (converted from pcm, flac or mp3 as needed)."""
        if self.format == "wav":
            return _fix_wav_sizes(self.audio)
        if self.format == "pcm":
            usable = self.audio[: len(self.audio) - len(self.audio) % 2]
            return _wav_header(self.sample_rate or _PCM_RATE, len(usable)) + usable
        try:
            import soundfile as sf  # only needed to convert compressed formats
        except ImportError as exc:
            raise RuntimeError(f"converting {self.format} to WAV needs soundfile") from exc
        samples, rate = sf.read(io.BytesIO(self.audio), dtype="float32")
        buf = io.BytesIO()
        sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
        return buf.getvalue()

    def to_wav(self, path: str | PathLike) -> Path:
        """Write the clip to ``path`` as a WAV file; returns the path."""
        target = Path(path)
        target.write_bytes(self.wav_bytes())
        return target


def _speech_meta(response: httpx.Response, fmt: str) -> tuple[str, int | None]:
    fmt = response.headers.get("x-audio-format", fmt)
    rate = response.headers.get("x-sample-rate", "")
    return fmt, int(rate) if rate.isdigit() else None


class SpeechStream:
    """Streamed speech: iterate for the bytes as they arrive (a WAV stream starts with
    its header), or ``read()`` / ``to_wav(path)`` to take it all. Single use; closing
    it early cancels the synthesis on the server."""

    def __init__(self, response: httpx.Response, fmt: str) -> None:
        self._response = response
        self.format, self.sample_rate = _speech_meta(response, fmt)
        self._consumed = False

    def __iter__(self) -> Iterator[bytes]:
        if self._consumed:
            raise RuntimeError("this speech stream was already consumed")
        self._consumed = True
        try:
            yield from self._response.iter_bytes()
        except httpx.TransportError as exc:
            raise MStarError(0, f"the stream broke off: {exc}") from exc
        finally:
            self._response.close()

    def read(self) -> SpeechResult:
        """All the (remaining) audio as one ``SpeechResult``."""
        return SpeechResult(b"".join(self), self.format, self.sample_rate)

    def to_wav(self, path: str | PathLike) -> Path:
        """Consume the stream and write it to ``path`` as a WAV file."""
        return self.read().to_wav(path)

    def close(self) -> None:
        self._response.close()

    def __enter__(self) -> SpeechStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SpeechMixin:
    """``MStarClient``'s text-to-speech methods (/v1/audio/speech, /v1/audio/voices)."""

    if TYPE_CHECKING:  # provided by MStarClient

        def _send(
            self, method: str, url: str, *, stream: bool = False, **kwargs: Any
        ) -> httpx.Response: ...

        def _json(self, method: str, url: str, **kwargs: Any) -> Any: ...

    @overload
    def tts(
        self, text: str, *, voice: str | None = None, model: str | None = None,
        response_format: str = "wav", stream: Literal[False] = False,
        reference_audio: str | PathLike | bytes | np.ndarray | None = None, ref_text: str | None = None,
        reference_sample_rate: int | None = None, **extra: Any,
    ) -> SpeechResult: ...

    @overload
    def tts(
        self, text: str, *, voice: str | None = None, model: str | None = None,
        response_format: str = "wav", stream: Literal[True],
        reference_audio: str | PathLike | bytes | np.ndarray | None = None, ref_text: str | None = None,
        reference_sample_rate: int | None = None, **extra: Any,
    ) -> SpeechStream: ...

    def tts(
        self,
        text: str,
        *,
        voice: str | None = None,
        model: str | None = None,
        response_format: str = "wav",
        stream: bool = False,
        reference_audio: str | PathLike | bytes | np.ndarray | None = None,
        ref_text: str | None = None,
        reference_sample_rate: int | None = None,
        **extra: Any,
    ) -> SpeechResult | SpeechStream:
        """Text to speech. ``extra`` goes into the body as is (speed, temperature, top_p,
        repetition_penalty, seed, max_tokens, sentence_chunking). ``stream=True``: a
        ``SpeechStream`` of the bytes as they are produced.

        ``reference_audio``: a voice to clone (models that clone only): a local file's path,
        its bytes, float samples with ``reference_sample_rate``, or a data URI / http(s) URL
        (the server fetches URLs only when it allows remote media); ``ref_text``: what the clip
        says. The clip goes in the body as a data URI (``ref_audio``)."""
        body: dict[str, Any] = {"input": text, "response_format": response_format}
        body.update({k: v for k, v in {"voice": voice, "model": model}.items() if v is not None})
        if reference_audio is not None:
            body["ref_audio"] = reference_field(reference_audio, reference_sample_rate)
        if ref_text is not None:
            body["ref_text"] = ref_text
        body.update(extra)
        if stream:
            body["stream"] = True
            response = self._send("POST", "/v1/audio/speech", json=body, stream=True)
            return SpeechStream(response, response_format)
        response = self._send("POST", "/v1/audio/speech", json=body)
        fmt, rate = _speech_meta(response, response_format)
        return SpeechResult(response.content, fmt, rate)

    def voices(self) -> list[str]:
        """The names of the voices the server's speech model offers (``voice_list`` has their
        language and source too)."""
        return [v["voice_id"] for v in self.voice_list()]

    def voice_list(self) -> list[dict[str, Any]]:
        """/v1/audio/voices as it is: per voice ``voice_id``, ``name``, ``model``, ``language``
        (or None) and ``source`` (``bundled`` or ``preset``)."""
        return list(self._json("GET", "/v1/audio/voices")["voices"])
