"""Server VAD for every Realtime session of an app: one Silero network, judged off the event loop.

Each session's 24 kHz input is resampled to 16 kHz as it arrives and appended to its stream
of a shared ``VadStreams``; a step (in a worker thread, so the loop keeps serving sockets)
judges the waiting chunks of every session at once, one batched network call per chunk
position. A lock serialises steps with appends (``VadStreams`` is not thread-safe), so a
session that appends while another's step runs joins the next batch. Turn events for a
session are handed to the callback it registered, whoever's append ran the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio
import numpy as np

from mstar.model.vad import TurnEvent, TurnSettings, VadStreams, load_silero_vad
from mstar.server.realtime.events import API_RATE
from mstar.server.realtime.resample import StreamResampler

__all__ = ["VadHub"]

VAD_RATE = 16000

TurnCallback = Callable[[TurnEvent], None]


class VadHub:
    """The app's turn detector. The network is loaded (in a thread) by the first session that
    turns detection on, so an app whose clients never use server VAD never loads it."""

    def __init__(self, load: Callable[[], object] = lambda: load_silero_vad(VAD_RATE)) -> None:
        self._load = load
        self._streams: VadStreams | None = None
        self._lock = asyncio.Lock()
        self._callbacks: dict[str, TurnCallback] = {}
        self._resamplers: dict[str, StreamResampler] = {}

    async def open(self, key: str, settings: TurnSettings, on_turn: TurnCallback) -> None:
        """Start (or restart, with new settings) ``key``'s stream; its time starts at zero."""
        async with self._lock:
            if self._streams is None:
                self._streams = VadStreams(await anyio.to_thread.run_sync(self._load))  # type: ignore[arg-type]
            self._streams.close(key)
            self._streams.open(key, settings)
            self._callbacks[key] = on_turn
            self._resamplers[key] = StreamResampler(API_RATE, VAD_RATE)

    async def close(self, key: str) -> None:
        """Forget ``key``'s stream (after a step that runs now: ``VadStreams`` is not thread-safe)."""
        self._callbacks.pop(key, None)
        self._resamplers.pop(key, None)
        async with self._lock:
            if self._streams is not None:
                self._streams.close(key)

    def __contains__(self, key: str) -> bool:
        return key in self._callbacks

    async def feed(self, key: str, samples: np.ndarray) -> None:
        """Append ``key``'s 24 kHz samples and judge every stream's waiting chunks."""
        resampler = self._resamplers.get(key)
        if resampler is None:
            return
        async with self._lock:
            assert self._streams is not None
            if key not in self._streams:
                return
            self._streams.append(key, resampler.push(samples))
            events = await anyio.to_thread.run_sync(self._streams.step)
        for owner, turns in events.items():
            callback = self._callbacks.get(owner)
            for turn in turns if callback is not None else ():
                callback(turn)
