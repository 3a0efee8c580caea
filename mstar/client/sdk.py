"""A small synchronous client for an M* server (chat completions, /generate, speech to
text, text to speech).

    >>> client = MStarClient("http://localhost:8000")
    >>> client.chat("Hello!", max_tokens=32).text
    >>> for event in client.chat("Tell me a story", stream=True):
    ...     print(event.text, end="", flush=True)
    >>> client.tts("Hello there.").to_wav("hello.wav")

Streams are opened eagerly (HTTP errors raise at the call); closing the returned iterator
(``events.close()`` or leaving a ``for`` loop and dropping it) closes the connection,
which cancels the request on the server.
"""

from __future__ import annotations

import base64
import io
import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Literal, overload

import httpx

FileLike = str | PathLike | tuple[str, bytes]


class MStarError(Exception):
    """An error from the server (``status`` is its HTTP status; 0: no response at all)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message
        self.param = param


@dataclass
class ChatResult:
    text: str
    finish_reason: str | None
    usage: dict[str, int]
    raw: dict


@dataclass
class ChatEvent:
    """One streamed chunk: ``text`` is the new text (delta); the last chunk carries
    ``finish_reason``; a final event carries ``usage``."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    raw: dict = field(default_factory=dict)


@dataclass
class TranscriptionResult:
    """Speech to text. For ``text``/``srt``/``vtt`` formats ``text`` is the raw body (and
    so is ``raw``); ``language``, ``duration`` and ``segments`` come with ``verbose_json``."""

    text: str
    language: str | None = None
    duration: float | None = None
    segments: list[dict] = field(default_factory=list)
    raw: dict | str = field(default_factory=dict)


@dataclass
class GenerateResult:
    request_id: str
    text: str
    finish_reason: str | None
    usage: dict[str, int]
    data: dict[str, bytes]  # non-text outputs by modality
    raw: dict
    sample_rate: int | None = None  # of data["audio"] (float32 mono), when there is audio


@dataclass
class GenerateEvent:
    request_id: str = ""
    modality: str = "text"
    text: str = ""
    data: bytes | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    raw: dict = field(default_factory=dict)
    sample_rate: int | None = None  # of audio ``data`` (float32 mono)


# ------------------------------------------------------------------- text to speech

_PCM_RATE = 24000  # OpenAI's documented rate for "pcm", when the server does not say
_UNKNOWN_SIZE = 0xFFFFFFFF


def _wav_header(sample_rate: int, data_bytes: int) -> bytes:
    """A RIFF/WAVE header for mono PCM16 data of ``data_bytes``."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    riff = b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE"
    return riff + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data_bytes)


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


def _error_of(status: int, body: Any) -> MStarError:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return MStarError(status, str(err.get("message", "")), err.get("param"))
    return MStarError(status, str(body))


_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
}


def _in_band_error(body: dict) -> MStarError:
    """An error the server sent inside a stream that had already started."""
    err = body.get("error")
    kind = err.get("type") if isinstance(err, dict) else None
    return _error_of(_STATUS_OF_TYPE.get(str(kind), 500), body)


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    response.read()
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise _error_of(response.status_code, body)


def _as_messages(text_or_messages: str | Sequence[Mapping[str, Any]]) -> list[dict]:
    if isinstance(text_or_messages, str):
        return [{"role": "user", "content": text_or_messages}]
    return [dict(m) for m in text_or_messages]


def _as_upload(item: FileLike) -> tuple[str, bytes]:
    if isinstance(item, tuple):
        name, content = item
        return name, bytes(content)
    path = Path(item)
    return path.name, path.read_bytes()


class MStarClient:
    """Synchronous client; usable as a context manager (closes its connection pool)."""

    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        timeout: float = 600,
        api_key: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- plumbing

    def _send(
        self, method: str, url: str, *, stream: bool = False, **kwargs: Any
    ) -> httpx.Response:
        request = self._http.build_request(method, url, **kwargs)
        try:
            response = self._http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise MStarError(0, f"cannot reach {self.base_url}: {exc}") from exc
        try:
            _raise_for_status(response)
        except BaseException:
            response.close()
            raise
        return response

    def _json(self, method: str, url: str, **kwargs: Any) -> Any:
        return self._send(method, url, **kwargs).json()

    # ---------------------------------------------------------------------- API

    def health(self) -> bool:
        """True when the server answers and its backend is healthy."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def models(self) -> list[str]:
        """The model names the server accepts."""
        return [m["id"] for m in self._json("GET", "/v1/models")["data"]]

    @overload
    def chat(
        self, text_or_messages: str | Sequence[Mapping[str, Any]], *,
        stream: Literal[False] = False, **kwargs: Any,
    ) -> ChatResult: ...

    @overload
    def chat(
        self, text_or_messages: str | Sequence[Mapping[str, Any]], *,
        stream: Literal[True], **kwargs: Any,
    ) -> Iterator[ChatEvent]: ...

    def chat(
        self,
        text_or_messages: str | Sequence[Mapping[str, Any]],
        *,
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        model: str | None = None,
        **extra: Any,
    ) -> ChatResult | Iterator[ChatEvent]:
        """A chat completion; ``extra`` goes into the request body as is (e.g. min_p)."""
        body: dict[str, Any] = {"messages": _as_messages(text_or_messages), "stream": stream}
        optional = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop": stop,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        body.update(extra)
        if not stream:
            raw = self._json("POST", "/v1/chat/completions", json=body)
            choice = raw["choices"][0]
            return ChatResult(
                text=choice["message"].get("content") or "",
                finish_reason=choice.get("finish_reason"),
                usage=raw.get("usage") or {},
                raw=raw,
            )
        body.setdefault("stream_options", {"include_usage": True})
        response = self._send("POST", "/v1/chat/completions", json=body, stream=True)
        return self._chat_events(response)

    @staticmethod
    def _chat_events(response: httpx.Response) -> Iterator[ChatEvent]:
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _in_band_error(chunk)
                choices = chunk.get("choices") or []
                if choices:
                    delta = choices[0].get("delta") or {}
                    yield ChatEvent(
                        text=delta.get("content") or "",
                        finish_reason=choices[0].get("finish_reason"),
                        usage=chunk.get("usage"),
                        raw=chunk,
                    )
                elif chunk.get("usage"):
                    yield ChatEvent(usage=chunk["usage"], raw=chunk)
        except httpx.TransportError as exc:
            raise MStarError(0, f"the stream broke off: {exc}") from exc
        finally:
            response.close()

    @overload
    def generate(
        self, text: str | None = None, files: Sequence[FileLike] | None = None,
        output_modalities: Sequence[str] = ..., model_kwargs: Mapping[str, Any] | None = None,
        stream: Literal[False] = False,
    ) -> GenerateResult: ...

    @overload
    def generate(
        self, text: str | None = None, files: Sequence[FileLike] | None = None,
        output_modalities: Sequence[str] = ..., model_kwargs: Mapping[str, Any] | None = None,
        *, stream: Literal[True],
    ) -> Iterator[GenerateEvent]: ...

    def generate(
        self,
        text: str | None = None,
        files: Sequence[FileLike] | None = None,
        output_modalities: Sequence[str] = ("text",),
        model_kwargs: Mapping[str, Any] | None = None,
        stream: bool = False,
    ) -> GenerateResult | Iterator[GenerateEvent]:
        """The native multimodal endpoint. ``files`` are paths or ``(name, bytes)`` pairs."""
        form = {
            "text": text or "",
            "output_modalities": json.dumps(list(output_modalities)),
            "streaming": "true" if stream else "false",
            "model_kwargs": json.dumps(dict(model_kwargs or {})),
        }
        uploads = [("files", _as_upload(f)) for f in files or []]
        kwargs: dict[str, Any] = {"data": form}
        if uploads:
            kwargs["files"] = uploads
        if not stream:
            raw = self._json("POST", "/generate", **kwargs)
            return GenerateResult(
                request_id=raw.get("request_id", ""),
                text=raw.get("text", ""),
                finish_reason=raw.get("finish_reason"),
                usage=raw.get("usage") or {},
                data={m: base64.b64decode(b) for m, b in (raw.get("data") or {}).items()},
                raw=raw,
                sample_rate=raw.get("sample_rate"),
            )
        return self._generate_events(self._send("POST", "/generate", stream=True, **kwargs))

    @overload
    def tts(
        self, text: str, *, voice: str | None = None, model: str | None = None,
        response_format: str = "wav", stream: Literal[False] = False, **extra: Any,
    ) -> SpeechResult: ...

    @overload
    def tts(
        self, text: str, *, voice: str | None = None, model: str | None = None,
        response_format: str = "wav", stream: Literal[True], **extra: Any,
    ) -> SpeechStream: ...

    def tts(
        self,
        text: str,
        *,
        voice: str | None = None,
        model: str | None = None,
        response_format: str = "wav",
        stream: bool = False,
        **extra: Any,
    ) -> SpeechResult | SpeechStream:
        """Text to speech. ``extra`` goes into the body as is (speed, temperature, top_p,
        repetition_penalty, seed, max_tokens). ``stream=True``: a ``SpeechStream`` of the
        bytes as they are produced."""
        body: dict[str, Any] = {"input": text, "response_format": response_format}
        body.update({k: v for k, v in {"voice": voice, "model": model}.items() if v is not None})
        body.update(extra)
        if stream:
            body["stream"] = True
            response = self._send("POST", "/v1/audio/speech", json=body, stream=True)
            return SpeechStream(response, response_format)
        response = self._send("POST", "/v1/audio/speech", json=body)
        fmt, rate = _speech_meta(response, response_format)
        return SpeechResult(response.content, fmt, rate)

    def voices(self) -> list[str]:
        """The voices the server's speech model offers."""
        return [v["voice_id"] for v in self._json("GET", "/v1/audio/voices")["voices"]]

    def transcribe(
        self,
        file: str | PathLike | bytes,
        *,
        model: str | None = None,
        language: str | None = None,
        prompt: str | None = None,
        response_format: str = "json",
        temperature: float | None = None,
        translate: bool = False,
        filename: str | None = None,
    ) -> TranscriptionResult:
        """Speech to text (``translate=True``: to English) from a path or the file's bytes."""
        if translate and language is not None:
            raise ValueError("translations take no language (the output is English)")
        if isinstance(file, bytes):
            name, content = filename or "audio", file
        else:
            name, content = _as_upload(file)
            name = filename or name
        form = {
            "model": model,
            "language": language,
            "prompt": prompt,
            "response_format": response_format,
            "temperature": None if temperature is None else str(temperature),
        }
        data = {k: v for k, v in form.items() if v is not None}
        url = "/v1/audio/translations" if translate else "/v1/audio/transcriptions"
        response = self._send("POST", url, data=data, files={"file": (name, content)})
        if response_format not in ("json", "verbose_json"):
            return TranscriptionResult(text=response.text, raw=response.text)
        raw = response.json()
        return TranscriptionResult(
            text=raw.get("text", ""),
            language=raw.get("language"),
            duration=raw.get("duration"),
            segments=list(raw.get("segments") or []),
            raw=raw,
        )

    @staticmethod
    def _generate_events(response: httpx.Response) -> Iterator[GenerateEvent]:
        try:
            for line in response.iter_lines():
                if not line.strip():
                    continue
                item = json.loads(line)
                if "error" in item:
                    raise _in_band_error(item)
                data = item.get("data")
                yield GenerateEvent(
                    request_id=item.get("request_id", ""),
                    modality=item.get("modality", "text"),
                    text=item.get("text") or "",
                    data=base64.b64decode(data) if data else None,
                    finish_reason=item.get("finish_reason"),
                    usage=item.get("usage"),
                    raw=item,
                    sample_rate=item.get("sample_rate"),
                )
        except httpx.TransportError as exc:
            raise MStarError(0, f"the stream broke off: {exc}") from exc
        finally:
            response.close()
