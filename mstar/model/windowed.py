"""Speech recognition over windows: an upload decoded, capped, cut at quiet points into
windows a model reads at once (``mstar.audio.windows``), each window its own walk, run
together; their texts joined. Shared by the FastConformer families (Parakeet, Nemotron ASR,
Canary, Canary-Qwen)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from mstar.audio import decode_audio, split_at_quiet_points
from mstar.contract import RequestError, Transcription, TranscriptionSegment
from mstar.model.spec import WalkOutput, WalkRequest

RunWalk = Callable[[WalkRequest], Awaitable[WalkOutput]]


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
