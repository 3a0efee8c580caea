"""Silero VAD: our network against the ``silero-vad`` package's own (6.2.3, its TorchScript
model run live), the released weights read from both of its layouts, batched streams equal to
solo ones, and the Realtime API's turn detection over the probabilities."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from mstar.model.vad import RATES, TurnDetector, TurnEvent, TurnSettings, VadState, VadStreams, load_silero_vad
from mstar.model.vad.silero import packaged_weights

silero_vad = pytest.importorskip("silero_vad")

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"


def _clip(rate: int) -> np.ndarray:
    """Half a second of silence, the speech clip's first 4 s, a second of faint noise."""
    speech, sr = soundfile.read(SPEECH, dtype="float32")
    assert sr == 16000
    speech = speech[:4 * sr] if rate == 16000 else speech[:4 * sr:2]
    noise = 0.003 * np.random.default_rng(0).standard_normal(rate).astype(np.float32)
    return np.concatenate([np.zeros(rate // 2, np.float32), speech, noise])


def _reference_probs(samples: np.ndarray, rate: int) -> list[float]:
    model = silero_vad.load_silero_vad()
    n = RATES[rate].chunk
    with torch.inference_mode():
        return [float(model(torch.from_numpy(samples[i:i + n])[None], rate))
                for i in range(0, len(samples) - n + 1, n)]


@pytest.mark.parametrize("rate", [16000, 8000])
def test_probabilities_equal_the_package(rate):
    samples = _clip(rate)
    model = load_silero_vad(rate)
    state, ours = VadState.zeros(1, model.rate), []
    n = model.rate.chunk
    with torch.inference_mode():
        for i in range(0, len(samples) - n + 1, n):
            prob, state = model(torch.from_numpy(samples[i:i + n])[None], state)
            ours.append(float(prob))
    reference = _reference_probs(samples, rate)
    assert np.abs(np.array(ours) - np.array(reference)).max() < 1e-5
    assert max(ours) > 0.9 and min(ours) < 0.1  # the clip has speech and silence: a real check


def test_the_safetensors_network_loads_and_hears_speech():
    """The package's ``silero_vad_16k.safetensors`` is another training of the same network (its
    weights differ from the default archive's): it loads with every key used and every
    parameter filled (strict), and it tells the clip's speech from its silence."""
    path = packaged_weights() / "silero_vad_16k.safetensors"
    model = load_silero_vad(16000, path)
    samples, state, probs = _clip(16000), VadState.zeros(1, model.rate), []
    with torch.inference_mode():
        for i in range(0, len(samples) - 511, 512):
            prob, state = model(torch.from_numpy(samples[i:i + 512])[None], state)
            probs.append(float(prob))
    assert max(probs[:15]) < 0.2 and np.mean(probs[20:120]) > 0.5  # 0.5 s of silence, then speech
    with pytest.raises(ValueError, match="16 kHz network only"):
        load_silero_vad(8000, path)


def test_batched_streams_equal_solo_streams():
    """Two sessions judged in one batch get the probabilities (and so the turns) each gets
    alone, whatever the other's audio."""
    model = load_silero_vad()
    clip = _clip(16000)
    other = np.random.default_rng(1).standard_normal(len(clip)).astype(np.float32) * 0.1

    def turns(streams: dict[str, np.ndarray]) -> dict[str, list[TurnEvent]]:
        vad = VadStreams(model)
        out = {key: [] for key in streams}
        for key in streams:
            vad.open(key, TurnSettings())
        for start in range(0, len(clip), 3000):  # appended in uneven pieces, as a client sends
            for key, samples in streams.items():
                vad.append(key, samples[start:start + 3000])
            for key, events in vad.step().items():
                out[key] += events
        return out

    together = turns({"a": clip, "b": other})
    assert together["a"] == turns({"a": clip})["a"]
    assert together["b"] == turns({"b": other})["b"]
    started, stopped = together["a"]
    assert started.kind == "started" and 0 < started.ms < 500  # speech begins at 500 ms, less the padding
    assert stopped.kind == "stopped" and 3500 < stopped.ms <= 4500


def test_a_pause_is_reported_before_the_turn_ends():
    # speech, a 128 ms dip (no pause), speech, then silence: paused at 200 ms of it, stopped at 500
    probs = [0.9] * 10 + [0.0] * 4 + [0.9] * 10 + [0.0] * 20
    events = _feed(probs, silence_duration_ms=500, pause_ms=200)
    kinds = [(i, e.kind) for i, e in events]
    assert kinds == [(0, "started"), (24 + 6, "paused"), (24 + 15, "stopped")]  # 7 x 32 >= 200, 16 x 32 >= 500
    assert events[1][1].ms == events[2][1].ms == 24 * 32  # the same speech end: the pause's read is the turn's
    # speech again after the pause: a new pause, and the turn ends later than the first pause's read
    probs = [0.9] * 10 + [0.0] * 8 + [0.9] * 5 + [0.0] * 20
    events = _feed(probs, silence_duration_ms=500, pause_ms=200)
    assert [e.kind for _, e in events] == ["started", "paused", "paused", "stopped"]
    assert events[1][1].ms == 10 * 32 and events[2][1].ms == events[3][1].ms == 23 * 32
    assert [e.kind for _, e in _feed(probs, silence_duration_ms=500)] == ["started", "stopped"]  # off by default


def _feed(probs: list[float], **settings) -> list[tuple[int, TurnEvent]]:
    detector = TurnDetector(TurnSettings(**settings), chunk_ms=32.0)
    return [(i, e) for i, p in enumerate(probs) if (e := detector.feed(p)) is not None]


def test_turns_start_with_padding_and_stop_after_the_silence():
    probs = [0.0] * 20 + [0.9] * 10 + [0.0] * 20
    events = _feed(probs, prefix_padding_ms=300, silence_duration_ms=200)
    start_chunk, started = events[0]
    assert start_chunk == 20 and started == TurnEvent("started", 20 * 32 - 300)
    stop_chunk, stopped = events[1]
    assert stopped == TurnEvent("stopped", 30 * 32)  # the end of the last speech chunk
    assert (stop_chunk + 1 - 30) * 32 >= 200 > (stop_chunk - 30) * 32  # the first chunk that fills the silence
    assert len(events) == 2


def test_a_dip_between_the_thresholds_does_not_end_speech():
    probs = [0.9] * 5 + [0.4] * 40 + [0.9] + [0.1] * 40  # 0.4: under 0.5, over 0.5 - 0.15
    events = _feed(probs, silence_duration_ms=300)
    assert [e.kind for _, e in events] == ["started", "stopped"]
    assert events[1][1].ms == 46 * 32


def test_a_short_silence_does_not_end_speech():
    probs = [0.9] * 5 + [0.0] * 5 + [0.9] * 5 + [0.0] * 30
    events = _feed(probs, silence_duration_ms=500)
    assert [e.kind for _, e in events] == ["started", "stopped"] and events[1][1].ms == 15 * 32


def test_settings_are_checked():
    with pytest.raises(ValueError, match="threshold"):
        TurnSettings(threshold=1.5)
    with pytest.raises(ValueError, match="negative"):
        TurnSettings(silence_duration_ms=-1)
    with pytest.raises(ValueError, match="512 samples"):
        load_silero_vad()(torch.zeros(1, 100), VadState.zeros(1, RATES[16000]))
