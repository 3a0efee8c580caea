"""Audio in and out of /v1/chat/completions, the OpenAI way.

In: an ``input_audio`` part (``{"data": base64, "format"}``) becomes the model's part
``{"type": "audio", "data": bytes}``, the file as sent (the model decodes it); the bytes are
capped, and a file that is plainly not audio (a video container, an image) is refused here.

Out: with ``modalities: ["text", "audio"]`` and ``audio: {voice, format}`` the backend's
text events are the answer's transcript and its audio events (mono float32 PCM at its
``sample_rate``) the speech. A whole answer is encoded in ``format`` (``message.audio``);
a streamed one goes out as ``delta.audio`` pieces of PCM16 whatever ``format`` names, as
OpenAI streams it, so that a client can play each piece as it comes.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from mstar.audio.encode import AudioEncoder, encode_audio, supported_formats
from mstar.audio.io import sniff_non_audio
from mstar.contract import RequestError
from mstar.server.backend import ServingBackend
from mstar.server.schemas import AudioAnswer, ChatCompletionRequest, DeltaAudio, InputAudio, new_id, now
from mstar.server.served import output_modalities

MAX_INPUT_AUDIO_BYTES = 25 * 1024 * 1024  # one input_audio part, decoded (OpenAI's upload limit)
_ENCODER_FORMAT = {"wav": "wav", "pcm16": "pcm", "flac": "flac", "mp3": "mp3"}  # OpenAI's name -> ours


def input_audio_bytes(part: InputAudio, field: str, max_bytes: int = MAX_INPUT_AUDIO_BYTES) -> bytes:
    """The file an ``input_audio`` part carries: its base64 decoded (a data URI's payload
    too), at most ``max_bytes`` (413), refused when empty, not base64 or not audio (400)."""
    text = part.data.strip()
    if text.startswith("data:"):
        header, _, text = text.partition(",")
        if not header.endswith(";base64"):
            raise RequestError(f"{field}.input_audio.data", "a data URI must be base64 (data:<type>;base64,...)")
    text = "".join(text.split())
    if len(text) // 4 * 3 > max_bytes + 2:  # refused by its length, before decoding
        raise RequestError(f"{field}.input_audio.data", f"the audio is larger than the limit of {max_bytes} bytes",
                           413)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{field}.input_audio.data", f"invalid base64: {exc}") from None
    if len(data) > max_bytes:
        raise RequestError(f"{field}.input_audio.data", f"the audio is larger than the limit of {max_bytes} bytes",
                           413)
    if not data:
        raise RequestError(f"{field}.input_audio.data", "holds no audio")
    if (what := sniff_non_audio(data[:512])) is not None:
        raise RequestError(f"{field}.input_audio.data", f"is {what}")
    return data


def check_audio_output(req: ChatCompletionRequest, backend: ServingBackend, model: str) -> None:
    """Refuse a spoken answer this model or server cannot give: a model that does not speak
    (naming ``modalities``), a format no encoder here writes (``audio.format``), a voice the
    model does not list (``audio.voice``; a model listing none judges the voice itself)."""
    if "audio" not in req.output_modalities or req.audio is None:
        return
    if "audio" not in output_modalities(backend):
        raise RequestError("modalities", f"model {model!r} answers in text only; use [\"text\"]")
    ours = _ENCODER_FORMAT.get(req.audio.format)
    if ours is None or ours not in supported_formats():
        choices = ", ".join(name for name, fmt in _ENCODER_FORMAT.items() if fmt in supported_formats())
        raise RequestError("audio.format", f"{req.audio.format!r} is not supported by this server; "
                                           f"use one of {choices}")
    voices = getattr(backend, "voices", None)
    listed = list(voices()) if voices is not None else []
    if listed and req.audio.voice not in listed:
        raise RequestError("audio.voice", f"unknown voice {req.audio.voice!r}; use one of {', '.join(listed)}")


def sample_rate(backend: ServingBackend) -> int:
    rate = int(getattr(backend, "sample_rate", 0) or 0)
    if rate <= 0:
        raise RuntimeError(f"backend {backend.model_id!r} declares audio output but no sample_rate")
    return rate


def whole_answer(pcm: bytes, transcript: str, fmt: str, rate: int) -> AudioAnswer:
    """``message.audio`` of a finished answer: ``pcm`` (float32 LE) encoded in OpenAI's ``fmt``."""
    samples = np.frombuffer(bytes(pcm[: len(pcm) - len(pcm) % 4]), dtype="<f4")
    encoded = encode_audio(samples, _ENCODER_FORMAT[fmt], rate)
    return AudioAnswer(id=new_id("audio"), data=base64.b64encode(encoded).decode("ascii"), expires_at=now(),
                       transcript=transcript)


class AudioDeltas:
    """The ``delta.audio`` pieces of one streamed spoken answer: ``transcript`` and ``speech``
    give the piece of a text or an audio event (None when there is nothing to send yet); the
    first piece carries the answer's ``id`` and ``expires_at``, ``last`` is OpenAI's closing
    piece with ``expires_at`` alone."""

    def __init__(self, rate: int) -> None:
        self.id = new_id("audio")
        self.expires_at = now()
        self._pcm16 = AudioEncoder("pcm", rate, streaming=True)
        self._started = False

    def _piece(self, **fields: str) -> DeltaAudio:
        if self._started:
            return DeltaAudio(**fields)
        self._started = True
        return DeltaAudio(id=self.id, expires_at=self.expires_at, **fields)

    def transcript(self, text: str) -> DeltaAudio | None:
        return self._piece(transcript=text) if text else None

    def speech(self, pcm: bytes) -> DeltaAudio | None:
        out = self._pcm16.feed(pcm)
        return self._piece(data=base64.b64encode(out).decode("ascii")) if out else None

    def last(self) -> DeltaAudio:
        return DeltaAudio(expires_at=self.expires_at)
