"""The backend of a many-model deployment (``mstar.model.composite``): each task served by the
part that does it, and ``respond``, the walk across parts that a voice agent is.

Every part's requests run on the one runtime (one conductor, one set of workers), through a
``RuntimeBackend`` over the part's ``PartView``: chat and completions go to the LLM part,
transcriptions to the recogniser, speech to the voice.

``respond`` answers a conversation in text and speech at once: the LLM's reply streams to the
caller as it is written, and every sentence, as soon as the text holds its end, becomes a
speech walk of its own on the voice part (``SPEAKING_AHEAD`` + 1 at most synthesising at a
time, their audio sent in sentence order), so the first sentence is heard while the rest is
still being written. Closing the stream early cancels the LLM walk and every speech walk,
which frees their pages and slots.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import replace

from mstar.contract import (
    ChatSpec,
    CompletionSpec,
    GenerateSpec,
    ImageSpec,
    OutputEvent,
    RequestError,
    SamplingParams,
    SpeechSpec,
    Transcription,
    TranscriptionSpec,
    Voice,
)
from mstar.model.composite import ComposedSpec
from mstar.runtime.backend import OnRuntime, RuntimeBackend
from mstar.runtime.runtime import Runtime

__all__ = ["ComposedBackend", "SentenceCutter"]

SPEAKING_AHEAD = 1
"""Sentences synthesising past the one whose audio is streaming."""


class SentenceCutter:
    """Cuts text that arrives in pieces into sentences to speak: a sentence ends at ``.``,
    ``!``, ``?`` (or ``;``, ``:``) followed by white space, or at a line break, unless what it
    ends has fewer than two letters (a list's "1."); a run of
    ``max_chars`` with no such end is cut at its last comma or space, so a long sentence does
    not hold the voice back. Markdown marks, which a voice would read out, are dropped."""

    END = re.compile(r"[.!?;:][\"')\]]*\s+|\n+")
    MARKS = re.compile(r"[*_#`~]+")

    def __init__(self, max_chars: int = 240):
        self.max_chars = max_chars
        self.held = ""

    def feed(self, text: str) -> list[str]:
        self.held += text
        out: list[str] = []
        start = 0  # where to look for a sentence end: past a list marker ("1. ") that is not one
        while True:
            match = self.END.search(self.held, start)
            if match is not None and sum(c.isalpha() for c in self.held[:match.start()]) < 2:
                start = match.end()
                continue
            if match is not None:
                cut = match.end()
            elif len(self.held) > self.max_chars:
                soft = max(self.held.rfind(", ", 0, self.max_chars), self.held.rfind(" ", 0, self.max_chars))
                cut = soft + 1 if soft > 0 else self.max_chars
            else:
                return out
            out += self._spoken(self.held[:cut])
            self.held, start = self.held[cut:], 0

    def flush(self) -> list[str]:
        rest, self.held = self.held, ""
        return self._spoken(rest)

    def _spoken(self, sentence: str) -> list[str]:
        sentence = self.MARKS.sub("", sentence).strip()
        return [sentence] if any(c.isalnum() for c in sentence) else []


class ComposedBackend(OnRuntime):
    """A ``ServingBackend`` (and ``RespondingBackend``) over a many-model deployment."""

    def __init__(self, spec: ComposedSpec, runtime: Runtime, *, timeout_s: float | None = None,
                 prepare_pool: Executor | None = None):
        self.spec = spec
        self.runtime = runtime
        self.model_id = spec.config.model
        self.tasks = spec.tasks
        self.parts = {part: RuntimeBackend(view, runtime, timeout_s=timeout_s,  # type: ignore[arg-type]
                                           prepare_pool=prepare_pool)
                      for part, view in spec.views.items()}
        for backend in self.parts.values():
            backend.model_id = self.model_id  # errors name the deployment the client asked for
        self.max_model_len = spec.max_model_len
        # each part's model answers to its own name too, for the tasks it serves here
        self.model_aliases: dict[str, frozenset[str]] = {}
        for task, part in spec.routes.items():
            if task in spec.tasks:
                name = spec.members[part].config.model
                self.model_aliases[name] = self.model_aliases.get(name, frozenset()) | {task}

    def _serving(self, task: str) -> RuntimeBackend:
        if task not in self.spec.routes:
            raise RequestError("model", f"model {self.model_id!r} does not serve {task}")
        return self.parts[self.spec.routes[task]]

    @property
    def input_modalities(self) -> frozenset[str]:
        return self.spec.part_for("chat").input_modalities if "chat" in self.spec.routes else frozenset({"text"})

    # ---------------------------------------------------------- each task
    def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        return self._serving("chat").chat(spec)

    def complete(self, spec: CompletionSpec) -> AsyncIterator[OutputEvent]:
        return self._serving("text_completion").complete(spec)

    def generate(self, spec: GenerateSpec) -> AsyncIterator[OutputEvent]:
        """/generate: an audio file is transcribed, anything else goes to the LLM."""
        return self._serving("transcription" if spec.files else "chat").generate(spec)

    async def transcribe(self, spec: TranscriptionSpec) -> Transcription:
        return await self._serving("translation" if spec.task == "translate" else "transcription").transcribe(spec)

    async def generate_images(self, spec: ImageSpec) -> list[bytes]:
        return await self._serving("image_generation").generate_images(spec)

    @property
    def sample_rate(self) -> int:
        return self._serving("speech").sample_rate

    @property
    def validates_speech_options(self) -> bool:
        return self._serving("speech").validates_speech_options

    @property
    def takes_instructions(self) -> bool:
        return self._serving("speech").takes_instructions

    @property
    def clones_voices(self) -> bool:
        return self._serving("speech").clones_voices

    def voices(self) -> list[str]:
        return self._serving("speech").voices()

    def voice_list(self) -> list[Voice]:
        return self._serving("speech").voice_list()

    def speech(self, spec: SpeechSpec) -> AsyncIterator[OutputEvent]:
        return self._serving("speech").speech(spec)

    # ------------------------------------------------------ the voice agent
    def reply_spec(self, spec: ChatSpec) -> ChatSpec:
        """``spec`` with the deployment's defaults: its system prompt first where the messages
        have no system message, its temperature where the spec left sampling at the default,
        its reply budget where the spec set none (or more)."""
        knobs = self.spec.knobs
        messages = spec.messages
        if not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": knobs.system_prompt}, *messages]
        sampling = spec.sampling if spec.sampling != SamplingParams() else SamplingParams(temperature=knobs.temperature)
        budget = knobs.max_reply_tokens if spec.max_tokens is None else min(spec.max_tokens, knobs.max_reply_tokens)
        return replace(spec, messages=messages, sampling=sampling, max_tokens=budget)

    async def respond(self, spec: ChatSpec, *, voice: str | None = None,
                      audio: bool = True) -> AsyncIterator[OutputEvent]:
        """The reply to ``spec``'s conversation, text and speech (module doc)."""
        reply = self.reply_spec(spec)
        if not audio:
            async with aclosing(self.chat(reply)) as events:
                async for event in events:
                    yield event
            return
        voice = voice if voice is not None else self.spec.knobs.voice
        out: asyncio.Queue[OutputEvent | BaseException | None] = asyncio.Queue()
        sentences: asyncio.Queue[str | None] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._write(reply, out, sentences)),
                 asyncio.ensure_future(self._speak(spec.request_id, voice, sentences, out))]
        final: OutputEvent | None = None
        try:
            for _ in range(2):  # each task puts None once it is done
                while (item := await out.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    if item.error or item.finish_reason in ("error", "cancelled"):
                        yield item
                        return
                    if item.finish_reason:  # the LLM's: sent once the last sentence is spoken
                        if item.text:
                            yield OutputEvent(text=item.text, token_ids=item.token_ids)
                        final = replace(item, text="", token_ids=[])
                    else:
                        yield item
            if final is not None:
                yield final
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _write(self, reply: ChatSpec, out: asyncio.Queue, sentences: asyncio.Queue) -> None:
        """The LLM's reply: its text to the caller at once, its sentences to the voice."""
        cutter = SentenceCutter()
        try:
            async with aclosing(self.chat(reply)) as events:
                async for event in events:
                    for sentence in cutter.feed(event.text):
                        sentences.put_nowait(sentence)
                    if event.finish_reason or event.error:
                        for sentence in cutter.flush():
                            sentences.put_nowait(sentence)
                    out.put_nowait(event)
        except Exception as exc:
            out.put_nowait(exc)
        finally:
            sentences.put_nowait(None)
            out.put_nowait(None)

    async def _speak(self, request_id: str, voice: str | None, sentences: asyncio.Queue,
                     out: asyncio.Queue) -> None:
        """Each sentence's audio, in order; ``SPEAKING_AHEAD`` more synthesising meanwhile."""
        slots = asyncio.Semaphore(SPEAKING_AHEAD + 1)
        pumps: list[asyncio.Task] = []
        speaker = self._serving("speech")

        async def pump(index: int, sentence: str, into: asyncio.Queue) -> None:
            try:
                async with slots:
                    piece = SpeechSpec(f"{request_id}-s{index}", sentence, voice=voice, sentence_chunking=False,
                                       stream=True)
                    async with aclosing(speaker.speech(piece)) as events:
                        async for event in events:
                            into.put_nowait(event)
            except Exception as exc:
                into.put_nowait(exc)
            finally:
                into.put_nowait(None)

        order: asyncio.Queue[asyncio.Queue | None] = asyncio.Queue()

        async def start_each() -> None:
            while (sentence := await sentences.get()) is not None:
                into: asyncio.Queue = asyncio.Queue()
                pumps.append(asyncio.ensure_future(pump(len(pumps), sentence, into)))
                order.put_nowait(into)
            order.put_nowait(None)

        starter = asyncio.ensure_future(start_each())
        try:
            while (into := await order.get()) is not None:
                while (event := await into.get()) is not None:
                    if isinstance(event, BaseException):
                        raise event
                    if event.error or event.finish_reason in ("error", "cancelled"):
                        out.put_nowait(event)
                        return
                    if event.data:
                        out.put_nowait(OutputEvent(modality=event.modality, data=event.data))
        except Exception as exc:
            out.put_nowait(exc)
        finally:
            starter.cancel()
            for task in pumps:
                task.cancel()
            await asyncio.gather(starter, *pumps, return_exceptions=True)
            out.put_nowait(None)
