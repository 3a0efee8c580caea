"""The HTTP tests' fake backend and live uvicorn server (their fixtures: tests/server/conftest.py).

The fake backend streams the words of the last user message (or of a completion's prompt;
token ids read as ``<id>`` words) back, one per event. Magic
words in that message change its behaviour: ``reject`` raises RequestError (422) on the
first advance, ``crash`` raises RuntimeError there, ``explode`` fails after two tokens,
``forever`` streams slowly without end (for cancellation tests).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
import uvicorn
from fastapi import FastAPI

from mstar.contract import ChatSpec, CompletionSpec, GenerateSpec, OutputEvent, RequestError

MODEL = "fake-model"


class FakeBackend:
    """A ServingBackend that echoes; records specs, completions and cancellations."""

    model_id = MODEL
    max_model_len = 4096
    tasks = frozenset({"chat", "text_completion"})

    def __init__(self) -> None:
        self.is_healthy = True
        self.chat_specs: list[ChatSpec] = []
        self.completion_specs: list[CompletionSpec] = []
        self.generate_specs: list[GenerateSpec] = []
        self.cancelled: list[str] = []  # the prompts of requests closed before they ended

    def healthy(self) -> bool:
        return self.is_healthy

    async def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        self.chat_specs.append(spec)
        prompt = next(m["content"] for m in reversed(spec.messages) if m["role"] == "user")
        prompt_tokens = sum(len(m["content"].split()) for m in spec.messages)
        async for event in self._stream(prompt, prompt_tokens, spec.max_tokens):
            yield event

    async def complete(self, spec: CompletionSpec) -> AsyncIterator[OutputEvent]:
        """The prompt's words back; with ``echo`` the prompt itself first, as one event."""
        self.completion_specs.append(spec)
        prompt = spec.prompt if isinstance(spec.prompt, str) else " ".join(f"<{t}>" for t in spec.prompt)
        first = True
        async for event in self._stream(prompt, len(prompt.split()), spec.max_tokens):
            if first and spec.echo:
                yield OutputEvent(text=prompt, prompt_tokens=event.prompt_tokens)
            first = False
            yield event

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[OutputEvent]:
        self.generate_specs.append(spec)
        words = spec.text + "".join(f" [{name}:{len(data)}]" for name, data in spec.files)
        async for event in self._stream(words, len(spec.text.split()), spec.model_kwargs.get("max_tokens")):
            if event.finish_reason and "audio" in spec.output_modalities:
                yield OutputEvent(modality="audio", data=b"RIFF-fake-audio", prompt_tokens=event.prompt_tokens)
            yield event

    async def _stream(
        self, prompt: str, prompt_tokens: int, max_tokens: int | None
    ) -> AsyncIterator[OutputEvent]:
        words = prompt.split()
        if "reject" in words:
            raise RequestError("messages", "the fake backend rejects this prompt", 422)
        if "crash" in words:
            raise RuntimeError("the fake backend crashed")
        finished = False
        try:
            if "forever" in words:
                while True:
                    await asyncio.sleep(0.02)
                    yield OutputEvent(text=" forever", prompt_tokens=prompt_tokens)
            for i, word in enumerate(words):
                await asyncio.sleep(0)
                if "explode" in words and i == 2:
                    raise RuntimeError("the fake backend exploded mid-stream")
                count = i + 1
                finish = "length" if max_tokens is not None and count >= max_tokens else None
                if finish is None and count == len(words):
                    finish = "stop"
                yield OutputEvent(
                    text=word if i == 0 else f" {word}",
                    token_ids=[i],
                    finish_reason=finish,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=count,
                )
                if finish:
                    break
            finished = True
        finally:
            if not finished:
                self.cancelled.append(prompt)


def spoken_samples(word: str, sample_rate: int = 16000) -> np.ndarray:
    """What ``SpeakingChatBackend`` says for ``word``: 10 ms of a tone set by the word (float32)."""
    t = np.arange(sample_rate // 100, dtype=np.float32) / sample_rate
    pitch = 200.0 + 40.0 * (sum(word.encode()) % 16)
    return (0.5 * np.sin(2 * np.pi * pitch * t)).astype(np.float32)


class SpeakingChatBackend(FakeBackend):
    """A chat model that hears and speaks: takes text and ``audio`` parts (each read as the
    word ``audio:<bytes>``) and, asked for ``["text", "audio"]``, sends before each word's text
    event its ``spoken_samples`` as float32 PCM, split unevenly across two events (a sample
    cut in half). ``voices()`` lists two voices."""

    input_modalities = frozenset({"text", "audio"})
    output_modalities = frozenset({"text", "audio"})
    sample_rate = 16000
    tasks = frozenset({"chat"})

    def voices(self) -> list[str]:
        return ["ember", "slate"]

    async def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        self.chat_specs.append(spec)
        content = next(m["content"] for m in reversed(spec.messages) if m["role"] == "user")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        prompt = " ".join(p["text"] if p["type"] == "text" else f"{p['type']}:{len(p['data'])}" for p in parts)
        async with aclosing(self._stream(prompt, len(prompt.split()), spec.max_tokens)) as events:
            async for event in events:
                if "audio" in spec.output_modalities:
                    pcm = spoken_samples(event.text.strip(), self.sample_rate).tobytes()
                    yield OutputEvent(modality="audio", data=pcm[:101])
                    yield OutputEvent(modality="audio", data=pcm[101:])
                yield event


class LiveServer:
    """Runs an app under uvicorn on 127.0.0.1 and a free port, in a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def wait_until(predicate, timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
