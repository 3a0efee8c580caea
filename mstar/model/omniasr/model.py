"""Omnilingual ASR CTC (``omnilingual_asr_ctc_{300m,1b,3b,7b}``): the declaration.

One stateless node, ``ctc``: a window's waveform (normalised to zero mean and unit variance)
through the wav2vec 2.0 encoder and the CTC head, its per-frame argmax back, batched across
requests (``engine.py``). An upload up to ``whole_seconds`` is one window; a longer one is cut
by the reference's policy (``windows.py``), each window its own walk, run together, their texts
joined. The CTC head covers every language: ``language``, ``prompt`` and ``temperature`` are
taken and have no effect. There are no timestamps: a segment is a window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import ClassVar

import torch

from mstar.audio import decode_audio
from mstar.contract import (
    GenerateSpec,
    OutputEvent,
    RequestError,
    Transcription,
    TranscriptionSegment,
    TranscriptionSpec,
)
from mstar.graph import Emit, Graph, Node, Sequential, Step, Walk
from mstar.model.omniasr.checkpoint import OmniAsrCheckpoint
from mstar.model.omniasr.config import HUB_REPOS, SAMPLE_RATE, SIZES
from mstar.model.omniasr.engine import ctc_engines
from mstar.model.omniasr.knobs import MODEL_SECONDS, OmniAsrKnobs, OmniAsrRequestKnobs
from mstar.model.omniasr.modeling import normalize_utterance
from mstar.model.omniasr.vocabulary import CtcVocabulary
from mstar.model.omniasr.windows import cut_windows
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkOutput, WalkRequest
from mstar.model.windowed import generate_audio_file

RunWalk = Callable[[WalkRequest], Awaitable[WalkOutput]]


class CtcTextStream(OutputStream):
    """A window's per-frame ids in, its text out (one event: the walk emits once)."""

    def __init__(self, vocabulary: CtcVocabulary) -> None:
        self.vocabulary, self.count = vocabulary, 0

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent:
        frames = value.reshape(-1).tolist()
        blank = self.vocabulary.blank_id
        ids = [t for i, t in enumerate(frames) if t != blank and (i == 0 or t != frames[i - 1])]
        self.count += len(ids)
        return OutputEvent(text=self.vocabulary.decode(frames), token_ids=ids, completion_tokens=self.count)

    @property
    def generated(self) -> int:
        return self.count


class OmniAsrCtcSpec(ModelSpec):
    """The shared declaration; a key names the size."""

    size: ClassVar[str]
    tasks = frozenset({"transcription"})
    Knobs: ClassVar[type[OmniAsrKnobs]] = OmniAsrKnobs
    knobs: OmniAsrKnobs

    def graph(self) -> Graph:
        ctc = Node("ctc", "stateless", inputs=("waveform",), outputs=("frame_ids",))
        walk = Walk("transcribe", Sequential(
            Step("ctc", reads="waveform", writes="frame_ids", emit=Emit("frame_ids", "text")),
        ), inputs=("waveform",))
        return Graph.build([ctc], [walk])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> OmniAsrCheckpoint:
        """The weights: ``checkpoint_path``, else ``model_path``, else the Hub's v1 release;
        with ``load_format: dummy`` and nothing local, the size's shapes and a stand-in vocabulary."""
        path = self.knobs.checkpoint_path or self.config.model_path or HUB_REPOS[self.size]
        try:
            return OmniAsrCheckpoint.locate(self.size, path, tokenizer_path=self.knobs.tokenizer_path,
                                            cache_dir=self.config.cache_dir)
        except FileNotFoundError:
            if self.config.load_format != "dummy":
                raise
            return OmniAsrCheckpoint.locate(self.size, None, tokenizer_path=self.knobs.tokenizer_path)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.vocabulary = ckpt.vocabulary(self.model_config.vocab_size)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> CtcTextStream:
        return CtcTextStream(self.vocabulary)

    def window_request(self, samples: torch.Tensor) -> WalkRequest:
        return WalkRequest("transcribe", {"waveform": normalize_utterance(samples)}, {}, {})

    def transcription_of(self, spec: GenerateSpec) -> TranscriptionSpec:
        """``/generate``: its one file is the audio, its ``model_kwargs`` the options; the clip
        is read whole (``whole``, default on here): one over 40 s is a 400, not cut."""
        filename, data = generate_audio_file(spec, self.key)
        options = OmniAsrRequestKnobs.parse({"whole": True} | dict(spec.model_kwargs))
        return TranscriptionSpec(spec.request_id, data, filename, language=options.language,
                                 model_kwargs=options.model_dump(exclude_none=True))

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        options = OmniAsrRequestKnobs.parse(spec.model_kwargs)
        whole, window = self.knobs.whole_seconds, self.knobs.window_seconds
        if options.window_seconds is not None:
            whole = window = options.window_seconds
        longest = self.knobs.max_audio_seconds
        if options.whole:
            whole = window = longest = MODEL_SECONDS
        audio = await asyncio.to_thread(decode_audio, spec.audio, max_bytes=self.knobs.max_upload_bytes,
                                        max_seconds=longest, target_rate=SAMPLE_RATE)
        least = self.model_config.min_samples
        if audio.samples.shape[0] < least:
            raise RequestError("file", f"the audio is shorter than {least / SAMPLE_RATE:.3f} s")
        windows = [(a, b) for a, b in cut_windows(audio.samples, SAMPLE_RATE, whole_s=whole, window_s=window)
                   if b - a >= least]
        samples = torch.from_numpy(audio.samples)
        gate = asyncio.Semaphore(max(self.config.max_concurrent_requests, 1))

        async def one(start: int, end: int) -> WalkOutput:
            async with gate:  # a long upload's windows wait here, not in the admission queue
                return await run(await asyncio.to_thread(self.window_request, samples[start:end]))

        results = await asyncio.gather(*[one(a, b) for a, b in windows])
        segments = [TranscriptionSegment(id=i, start=a / SAMPLE_RATE, end=b / SAMPLE_RATE, text=out.text.strip(),
                                         tokens=out.token_ids)
                    for i, ((a, b), out) in enumerate(zip(windows, results))]
        return Transcription(text=" ".join(s.text for s in segments if s.text), language=spec.language or "",
                             duration=audio.duration, segments=segments)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        ckpt = self.checkpoint()
        model = ckpt.load_model(device, self.config.torch_dtype(), dummy=self.config.load_format == "dummy",
                                seed=self.knobs.seed)
        return ctc_engines(model, nodes, max_batch_size=self.knobs.max_batch_size,
                           max_batch_seconds=self.knobs.max_batch_seconds)


def _size_key(size: str) -> type[OmniAsrCtcSpec]:
    name = f"OmniAsrCtc{size.upper()}"
    cls = type(name, (OmniAsrCtcSpec,), {"key": f"omnilingual_asr_ctc_{size}", "size": size,
                                         "default_weights": HUB_REPOS[size], "__module__": __name__,
                                         "__doc__": f"Omnilingual ASR CTC {size.upper()} (v1 weights from the Hub)."})
    return register(cls)


OmniAsrCtc300M, OmniAsrCtc1B, OmniAsrCtc3B, OmniAsrCtc7B = (_size_key(s) for s in SIZES)

__all__ = ["CtcTextStream", "OmniAsrCtc1B", "OmniAsrCtc300M", "OmniAsrCtc3B", "OmniAsrCtc7B", "OmniAsrCtcSpec"]
