"""A fake backend with every capability the app mounts routes for (chat, text completions, generate,
transcription, speech, images), for the OpenAPI and fuzzing tests: each call succeeds
quickly with small, well-formed output, whatever text it is given."""

from __future__ import annotations

import io
import math
import struct
from collections.abc import AsyncIterator

from PIL import Image

from mstar.contract import (
    TASKS,
    ChatSpec,
    GenerateSpec,
    ImageSpec,
    OutputEvent,
    RequestError,
    SpeechSpec,
    Transcription,
    TranscriptionSegment,
    TranscriptionSpec,
)
from tests.support.fake_backend import FakeBackend


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


class EveryCapabilityBackend(FakeBackend):
    sample_rate = 24000
    tasks = frozenset(TASKS)
    png = _png()

    async def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        """Echo the last message, whatever its role (the schema allows no user message)."""
        prompt = spec.messages[-1]["content"]
        async for event in self._stream(prompt, len(prompt.split()), spec.max_tokens):
            yield event

    async def _stream(self, prompt: str, prompt_tokens: int, max_tokens: int | None) -> AsyncIterator[OutputEvent]:
        """The words back, one an event, up to ``max_tokens`` (no magic words: fuzzed text
        must not make the fake crash or stream forever)."""
        words = prompt.split()[: max_tokens or None] or [""]
        for i, word in enumerate(words):
            last = i == len(words) - 1
            yield OutputEvent(text=f" {word}", token_ids=[i], prompt_tokens=prompt_tokens, completion_tokens=i + 1,
                              finish_reason="stop" if last else None)

    def voices(self) -> list[str]:
        return ["alba", "bruno"]

    async def speech(self, spec: SpeechSpec) -> AsyncIterator[OutputEvent]:
        pcm = struct.pack("<64f", *(0.1 * math.sin(i / 4) for i in range(64)))
        yield OutputEvent(modality="audio", data=pcm)
        yield OutputEvent(modality="audio", finish_reason="stop")

    async def transcribe(self, spec: TranscriptionSpec) -> Transcription:
        segment = TranscriptionSegment(0, 0.0, 1.0, " hello")
        return Transcription(" hello", spec.language or "en", 1.0, [segment])

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[OutputEvent]:
        if spec.output_modalities != ["video"]:
            async for event in super().generate(spec):
                yield event
            return
        kwargs = spec.model_kwargs  # a grey video, small sizes only; defaults as wan22's
        width, height, frames = kwargs.get("width", 1280), kwargs.get("height", 704), kwargs.get("num_frames", 81)
        if width * height * frames > 64 * 64 * 9:
            raise RequestError("num_frames", "over the fake's 64 x 64 x 9 pixels")
        yield OutputEvent(modality="video", data=bytes([128]) * (width * height * frames * 3))
        yield OutputEvent(modality="video", finish_reason="stop")

    async def generate_images(self, spec: ImageSpec) -> list[bytes]:
        return [self.png] * spec.n
