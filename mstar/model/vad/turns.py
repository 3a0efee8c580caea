"""Turn detection over a stream of audio: when the user starts and stops speaking.

The Realtime API's ``server_vad`` (``threshold``, ``prefix_padding_ms``,
``silence_duration_ms``) over Silero's per-chunk speech probabilities. A stream is quiet until
a chunk's probability reaches ``threshold``: speech has started, and the turn's audio begins
``prefix_padding_ms`` before that chunk (so the first syllable is not cut). While speaking, a
chunk below ``threshold - hysteresis`` starts a silence (as Silero's own segmenter, a dip just
under the threshold does not end speech); a chunk at or above ``threshold`` ends it; a silence
that lasts ``silence_duration_ms`` stops the speech, at the end of the last speech chunk.

``TurnDetector`` is one stream's state machine, fed probabilities; ``VadStreams`` holds the
streams of many sessions and judges all their pending chunks in batched network calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mstar.model.vad.silero import SileroVAD, VadState

__all__ = ["TurnDetector", "TurnEvent", "TurnSettings", "VadStreams"]


@dataclass(frozen=True)
class TurnSettings:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    hysteresis: float = 0.15
    # Report a ``paused`` event once a silence has lasted this long (None: never): a listener
    # may start reading the turn then, before ``silence_duration_ms`` says it has ended.
    pause_ms: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be between 0 and 1, got {self.threshold}")
        if self.prefix_padding_ms < 0 or self.silence_duration_ms < 0:
            raise ValueError("prefix_padding_ms and silence_duration_ms must not be negative")


@dataclass(frozen=True)
class TurnEvent:
    """``kind`` ``started`` (``ms``: where the turn's audio begins, padding included),
    ``paused`` (a silence of ``pause_ms`` within the turn; ``ms``: the end of the last speech
    chunk; the turn may go on) or ``stopped`` (``ms``: the end of the last speech chunk, the
    same as a ``paused`` before it when nobody spoke in between), in ms of the stream."""

    kind: str
    ms: int


@dataclass
class TurnDetector:
    """One stream's speaking state, fed one chunk's probability at a time."""

    settings: TurnSettings
    chunk_ms: float
    chunks: int = 0  # judged so far
    speaking: bool = False
    last_speech_end: float = 0.0  # ms
    silence_since: float | None = None  # ms, while speaking
    paused: bool = False  # this silence was reported as a pause

    def feed(self, prob: float) -> TurnEvent | None:
        start = self.chunks * self.chunk_ms
        end = start + self.chunk_ms
        self.chunks += 1
        s = self.settings
        if not self.speaking:
            if prob >= s.threshold:
                self.speaking, self.last_speech_end, self.silence_since = True, end, None
                return TurnEvent("started", int(max(0.0, start - s.prefix_padding_ms)))
            return None
        if prob >= s.threshold:
            self.last_speech_end, self.silence_since, self.paused = end, None, False
        elif prob < s.threshold - s.hysteresis:
            if self.silence_since is None:
                self.silence_since = start
            if end - self.silence_since >= s.silence_duration_ms:
                self.speaking, self.silence_since, self.paused = False, None, False
                return TurnEvent("stopped", int(self.last_speech_end))
            if s.pause_ms is not None and not self.paused and end - self.silence_since >= s.pause_ms:
                self.paused = True
                return TurnEvent("paused", int(self.last_speech_end))
        else:  # between the thresholds: neither speech nor silence; a running silence goes on
            pass
        return None


@dataclass
class _Stream:
    detector: TurnDetector
    state: VadState
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))


class VadStreams:
    """Many streams (one per session) on one network: ``append`` audio at the network's rate,
    ``step`` judges every whole chunk waiting in any stream, the streams' next chunks as one
    batch per call, and returns each stream's turn events."""

    def __init__(self, model: SileroVAD) -> None:
        self.model = model
        self.rate = model.rate
        self._streams: dict[str, _Stream] = {}

    def open(self, key: str, settings: TurnSettings) -> None:
        chunk_ms = 1000.0 * self.rate.chunk / self.rate.sample_rate
        self._streams[key] = _Stream(TurnDetector(settings, chunk_ms), VadState.zeros(1, self.rate))

    def close(self, key: str) -> None:
        self._streams.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._streams

    def append(self, key: str, samples: np.ndarray) -> None:
        stream = self._streams[key]
        stream.pending = np.concatenate([stream.pending, np.asarray(samples, np.float32)])

    @torch.inference_mode()
    def step(self) -> dict[str, list[TurnEvent]]:
        events: dict[str, list[TurnEvent]] = {key: [] for key in self._streams}
        n = self.rate.chunk
        while True:
            ready = [(key, s) for key, s in self._streams.items() if len(s.pending) >= n]
            if not ready:
                return events
            chunks = torch.from_numpy(np.stack([s.pending[:n] for _, s in ready]))
            probs, state = self.model(chunks, VadState.stack([s.state for _, s in ready]))
            for (key, stream), prob, row in zip(ready, probs.tolist(), state.unbind()):
                stream.pending, stream.state = stream.pending[n:], row
                event = stream.detector.feed(prob)
                if event is not None:
                    events[key].append(event)
