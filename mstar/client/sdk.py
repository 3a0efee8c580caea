"""A small synchronous client for an M* server (chat and text completions, /generate, speech
to text, text to speech, images, video).

    >>> client = MStarClient("http://localhost:8000")
    >>> client.chat("Hello!", max_tokens=32).text
    >>> client.complete("The capital of France is", max_tokens=8).text
    >>> for event in client.chat("Tell me a story", stream=True):
    ...     print(event.text, end="", flush=True)
    >>> client.tts("Hello there.").to_wav("hello.wav")
    >>> Path("cat.png").write_bytes(client.generate_image("a cat", width=512, height=512))
    >>> client.generate_video("a cat walks", seconds=2).save("cat.mp4")
    >>> client.act(images=["base.png"], state=[0.1, 0.2], prompt="pick the cube").actions
    >>> async with client.realtime() as conn:  # the Realtime API (mstar.client.realtime)
    ...     await conn.send({"type": "response.create"})

Streams are opened eagerly (HTTP errors raise at the call); closing the returned iterator
(``events.close()`` or leaving a ``for`` loop and dropping it) closes the connection,
which cancels the request on the server.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Literal, overload

import httpx

from mstar.client.actions import ActionResult, ActionsMixin
from mstar.client.errors import MStarError, in_band_error, raise_for_status
from mstar.client.images import ImagesMixin
from mstar.client.realtime import RealtimeConnection, RealtimeMixin
from mstar.client.speech import SpeechMixin, SpeechResult, SpeechStream
from mstar.client.videos import VideoResult, VideosMixin

__all__ = [
    "ActionResult", "ChatEvent", "ChatResult", "GenerateEvent", "GenerateResult", "MStarClient", "MStarError",
    "RealtimeConnection", "SpeechResult", "SpeechStream", "TranscriptionResult", "VideoResult",
]

FileLike = str | PathLike | tuple[str, bytes]


@dataclass
class ChatResult:
    """A chat completion, or a text completion (``complete``)."""

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
    data: dict[str, bytes | list[bytes]]  # non-text outputs by modality (images: a list if n > 1)
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
    progress: tuple[int, int] | None = None  # modality "progress": denoising step k of n done


def _decode_data(encoded: str | list[str]) -> bytes | list[bytes]:
    """A /generate result's base64 data (a list of them for several images)."""
    if isinstance(encoded, list):
        return [base64.b64decode(item) for item in encoded]
    return base64.b64decode(encoded)


def _choice_text(choice: Mapping[str, Any]) -> str:
    """A choice's text: a chat message's or delta's content, or a text completion's text."""
    if "text" in choice:
        return choice["text"] or ""
    message = choice.get("message") or choice.get("delta") or {}
    return message.get("content") or ""


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


class MStarClient(SpeechMixin, ImagesMixin, VideosMixin, RealtimeMixin, ActionsMixin):
    """Synchronous client; usable as a context manager (closes its connection pool).
    Text to speech (``tts``, ``voices``), images (``generate_image``, ``edit_image``) and
    video (``generate_video``) come from the mixins in ``mstar.client.speech``,
    ``mstar.client.images`` and ``mstar.client.videos``; the
    Realtime API (``realtime()``, async) from ``mstar.client.realtime``."""

    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        timeout: float = 600,
        api_key: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
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
            raise_for_status(response)
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
        body = {"messages": _as_messages(text_or_messages), "stream": stream, "model": model,
                "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "seed": seed, "stop": stop}
        return self._text("/v1/chat/completions", body, extra)

    @overload
    def complete(
        self, prompt: str | Sequence[int], *, stream: Literal[False] = False, **kwargs: Any,
    ) -> ChatResult: ...

    @overload
    def complete(
        self, prompt: str | Sequence[int], *, stream: Literal[True], **kwargs: Any,
    ) -> Iterator[ChatEvent]: ...

    def complete(
        self,
        prompt: str | Sequence[int],
        *,
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        echo: bool | None = None,
        model: str | None = None,
        **extra: Any,
    ) -> ChatResult | Iterator[ChatEvent]:
        """A text completion (/v1/completions): ``prompt`` (text or token ids) continued with
        no chat template; the server's ``max_tokens`` default is 16. ``extra`` goes into the
        request body as is (e.g. ignore_eos)."""
        body = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "stream": stream, "model": model,
                "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "seed": seed, "stop": stop, "echo": echo}
        return self._text("/v1/completions", body, extra)

    def _text(self, url: str, fields: dict[str, Any], extra: Mapping[str, Any]) -> ChatResult | Iterator[ChatEvent]:
        """POST a chat or text completion: ``fields`` that are not None, then ``extra``."""
        body = {k: v for k, v in fields.items() if v is not None} | dict(extra)
        if not body["stream"]:
            raw = self._json("POST", url, json=body)
            choice = raw["choices"][0]
            return ChatResult(
                text=_choice_text(choice),
                finish_reason=choice.get("finish_reason"),
                usage=raw.get("usage") or {},
                raw=raw,
            )
        body.setdefault("stream_options", {"include_usage": True})
        return self._chat_events(self._send("POST", url, json=body, stream=True))

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
                    raise in_band_error(chunk)
                choices = chunk.get("choices") or []
                if choices:
                    yield ChatEvent(
                        text=_choice_text(choices[0]),
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
        stream: Literal[False] = False, *, session_id: str | None = None, resume_session: bool = False,
        end_session: bool = False, session_timeout_s: float | None = None,
    ) -> GenerateResult: ...

    @overload
    def generate(
        self, text: str | None = None, files: Sequence[FileLike] | None = None,
        output_modalities: Sequence[str] = ..., model_kwargs: Mapping[str, Any] | None = None,
        *, stream: Literal[True], session_id: str | None = None, resume_session: bool = False,
        end_session: bool = False, session_timeout_s: float | None = None,
    ) -> Iterator[GenerateEvent]: ...

    def generate(
        self,
        text: str | None = None,
        files: Sequence[FileLike] | None = None,
        output_modalities: Sequence[str] = ("text",),
        model_kwargs: Mapping[str, Any] | None = None,
        stream: bool = False,
        *,
        session_id: str | None = None,
        resume_session: bool = False,
        end_session: bool = False,
        session_timeout_s: float | None = None,
    ) -> GenerateResult | Iterator[GenerateEvent]:
        """The native multimodal endpoint. ``files`` are paths or ``(name, bytes)`` pairs.
        ``session_id`` names a world-state session (``resume_session`` continues it,
        ``end_session`` drops it after this request; a busy session raises ``MStarError``
        409, a gone one 410; see docs/sessions.md)."""
        form = {
            "text": text or "",
            "output_modalities": json.dumps(list(output_modalities)),
            "streaming": "true" if stream else "false",
            "model_kwargs": json.dumps(dict(model_kwargs or {})),
        }
        if session_id is not None:
            form |= {"session_id": session_id, "resume_session": str(resume_session).lower(),
                     "end_session": str(end_session).lower()}
            if session_timeout_s is not None:
                form["session_timeout_s"] = str(session_timeout_s)
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
                data={m: _decode_data(b) for m, b in (raw.get("data") or {}).items()},
                raw=raw,
                sample_rate=raw.get("sample_rate"),
            )
        return self._generate_events(self._send("POST", "/generate", stream=True, **kwargs))

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
                    raise in_band_error(item)
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
                    progress=(item["step"], item["total"]) if item.get("modality") == "progress" else None,
                )
        except httpx.TransportError as exc:
            raise MStarError(0, f"the stream broke off: {exc}") from exc
        finally:
            response.close()
