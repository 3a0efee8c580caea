"""Speech recognition over windows: an upload decoded, capped, cut at quiet points into
windows a model reads at once (``mstar.audio.windows``), each window its own walk, run
together; their texts joined. Shared by the FastConformer families (Parakeet, Nemotron ASR,
Canary, Canary-Qwen)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from mstar.audio import decode_audio, split_at_quiet_points
from mstar.contract import GenerateSpec, RequestError, Transcription, TranscriptionSegment, TranscriptionSpec
from mstar.model.knobs import RequestKnobs
from mstar.model.spec import WalkOutput, WalkRequest

RunWalk = Callable[[WalkRequest], Awaitable[WalkOutput]]


def generate_audio_file(spec: GenerateSpec, key: str) -> tuple[str, bytes]:
    """The one audio file (name, bytes) of a ``/generate`` transcription; a 400 naming ``files``
    for none or several, naming ``output_modalities`` for anything but text."""
    if len(spec.files) != 1:
        raise RequestError("files", "send exactly one audio file to transcribe")
    if set(spec.output_modalities) - {"text"}:
        raise RequestError("output_modalities", f"model {key!r} outputs text only")
    return spec.files[0]


def options_transcription(spec: GenerateSpec, key: str, options: type[RequestKnobs]) -> TranscriptionSpec:
    """``/generate`` as a transcription whose ``model_kwargs`` are its options: checked by
    ``options`` here (a 400 naming the field) and handed on whole; its text is not read."""
    filename, data = generate_audio_file(spec, key)
    options.parse(spec.model_kwargs)
    return TranscriptionSpec(spec.request_id, data, filename, model_kwargs=dict(spec.model_kwargs))


async def transcribe_windows(audio: bytes, run: RunWalk, window_request: Callable[[torch.Tensor], WalkRequest], *,
                             sample_rate: int, max_bytes: int, max_seconds: float, max_window_s: float,
                             min_samples: int, language: str, parallel: int) -> Transcription:
    """The transcript of ``audio``: windows of at most ``max_window_s`` (a trailing one shorter
    than ``min_samples`` is dropped), each turned into a walk by ``window_request`` (called off
    the event loop) and run by ``run``, at most ``parallel`` at a time (a long upload never
    fills the admission queue by itself: its windows wait here, not there)."""
    decoded = await asyncio.to_thread(decode_audio, audio, max_bytes=max_bytes, max_seconds=max_seconds,
                                      target_rate=sample_rate)
    if decoded.samples.shape[0] < min_samples:
        raise RequestError("file", f"the audio is shorter than {min_samples / sample_rate:.3f} s")
    samples = torch.from_numpy(decoded.samples)
    windows = [(start, end) for start, end in split_at_quiet_points(decoded.samples, sample_rate,
                                                                    max_window_s=max_window_s)
               if end - start >= min_samples]

    gate = asyncio.Semaphore(max(parallel, 1))

    async def window(start: int, end: int) -> WalkOutput:
        async with gate:
            return await run(await asyncio.to_thread(window_request, samples[start:end]))

    results = await asyncio.gather(*[window(start, end) for start, end in windows])
    segments = [TranscriptionSegment(id=i, start=start / sample_rate, end=end / sample_rate,
                                     text=out.text.strip(), tokens=out.token_ids)
                for i, ((start, end), out) in enumerate(zip(windows, results))]
    return Transcription(text=" ".join(s.text for s in segments if s.text), language=language,
                         duration=decoded.duration, segments=segments)
