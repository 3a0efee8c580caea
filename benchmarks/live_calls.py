"""Live calls of a full-duplex model (``live_stream``: Nemotron VoiceChat) driven in process
through the API a ``/generate/ws`` socket uses, and their clocks: S15's client.

``live_call`` runs one call as the socket does (``generate`` with ``live_input``, its appends
into the model's ``live_stream``, ``end_input``) and stamps every agent frame as it arrives;
``summarise`` turns the clocks of a call count's rounds into tick, first-frame and lag figures.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

FRAME_S = 0.08  # one append and one agent frame
PROMPT = "You are a helpful voice assistant."


@dataclass
class CallTiming:
    """One call's clock: when its appends were due and sent, when its agent frames arrived."""

    submitted: float = 0.0
    due: list[float] = field(default_factory=list)  # append k's (and then end_input's) due time
    text: list[float] = field(default_factory=list)  # one per agent text token
    audio: list[float] = field(default_factory=list)  # one per completed audio frame
    samples: int = 0
    finish: str | None = None
    error: str | None = None


async def live_call(backend, request_id: str, items: list, pace_s: float | None, start: float, outputs: list[str],
                    seed: int, samples_per_frame: int, pad: int, prompt: str = PROMPT) -> CallTiming:
    """One live call as ``/generate/ws`` runs it: ``generate`` with ``live_input``, the
    ``items`` (each made by ``backend.append_item``) appended into ``live_stream`` (append k
    due at ``start + k pace_s``; None: each as soon as the call is known), then ``end_input``;
    every output stamped as it arrives. The float32 PCM counts as agent frames of
    ``samples_per_frame`` samples, the first ``pad`` short (the codec's overlap, flushed at
    the end)."""
    from mstar.contract import GenerateSpec

    timing = CallTiming()
    spec = GenerateSpec(request_id=request_id, text=prompt, files=[], output_modalities=outputs,
                        model_kwargs={"seed": seed}, stream=True, live_input=True)

    async def pump() -> None:
        while not backend.knows(request_id):
            await asyncio.sleep(0.001)
        stream = backend.live_stream
        for k, item in enumerate([*items, None]):
            due = start + k * pace_s if pace_s else time.perf_counter()
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            timing.due.append(due)
            if item is None:
                backend.end_input(request_id)
            else:
                backend.append(request_id, stream, item)

    timing.submitted = time.perf_counter()
    pumping = asyncio.ensure_future(pump())
    try:
        async with aclosing(backend.generate(spec)) as events:
            async for event in events:
                now = time.perf_counter()
                if event.error:
                    timing.error = event.error
                if event.data is not None:
                    before = (timing.samples + pad) // samples_per_frame
                    timing.samples += len(event.data) // 4
                    timing.audio += [now] * ((timing.samples + pad) // samples_per_frame - before)
                elif event.token_ids:
                    timing.text += [now] * len(event.token_ids)
                timing.finish = event.finish_reason or timing.finish
    finally:
        pumping.cancel()
        await asyncio.gather(pumping, return_exceptions=True)
    return timing


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (p90 of a few values is never below p50)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered), math.ceil(q * len(ordered))) - 1)]


def summarise(runs: list[tuple[float, list[CallTiming]]], pace: str, speech: bool) -> dict[str, Any]:
    """One call count's figures in one pacing over every call of every run (times in ms);
    ``runs``: each run's wall time (first submit to last output) and its calls' clocks."""
    timings = [t for _, ts in runs for t in ts]
    frames = [t.audio if speech else t.text for t in timings]
    ticks = [1e3 * (b - a) for f in frames for a, b in zip(f, f[1:])]
    mean_tick = [1e3 * (f[-1] - f[0]) / (len(f) - 1) for f in frames]
    first = [1e3 * (f[0] - t.submitted) for f, t in zip(frames, timings)]
    out: dict[str, Any] = {
        "tick_ms_p50": statistics.median(ticks), "tick_ms_p90": percentile(ticks, 0.9), "tick_ms_max": max(ticks),
        "call_mean_tick_ms_max": max(mean_tick),
        "calls_within_real_time": sum(m <= 1e3 * FRAME_S for m in mean_tick) / len(runs),
        "first_frame_ms_p50": statistics.median(first), "first_frame_ms_max": max(first),
        "first_text_ms_p50": statistics.median(1e3 * (t.text[0] - t.submitted) for t in timings),
        "frames_per_s": statistics.median(sum(len(t.audio if speech else t.text) for t in ts) / wall
                                          for wall, ts in runs),
        "frames_per_call": len(frames[0]), "wall_s": [wall for wall, _ in runs]}
    if pace == "realtime":
        lags, drifts = [], []
        for f, t in zip(frames, timings):
            lag = [1e3 * (arrived - due) for arrived, due in zip(f, t.due)]
            lags += lag
            quarter = max(1, len(lag) // 4)
            drifts.append(statistics.median(lag[-quarter:]) - statistics.median(lag[:quarter]))
        out.update({"lag_ms_p50": statistics.median(lags), "lag_ms_p90": percentile(lags, 0.9),
                    "lag_ms_max": max(lags), "lag_drift_ms_max": max(drifts),
                    "calls_kept_up": sum(d < 1e3 * FRAME_S for d in drifts) / len(runs),
                    "first_frame_live_ms_p50": statistics.median(1e3 * (f[0] - t.due[0])
                                                                  for f, t in zip(frames, timings))})
    return out
