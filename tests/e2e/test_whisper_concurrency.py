"""Concurrency on a real (in-process) Whisper base deployment: transcriptions decoded
together in batches must give exactly what each gives alone, and every resource a request
took (self-attention KV pages, the cross-attention cache) must come back afterwards."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from inprocess import Recorder, poll_drained, record_batches

from mstar.config import parse_config
from mstar.contract import Transcription, TranscriptionSpec
from mstar.runtime.launch import Deployment, start

CLIP = Path(__file__).resolve().parents[1] / "data" / "speech_en.wav"
# (language, prompt): detected or forced English, with or without a decoder prompt
VARIANTS = [
    (None, None),
    ("en", None),
    (None, "Foxes and dogs."),
    ("en", "A pangram, then a sentence about speech recognition."),
]
CONCURRENT = 8


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    d = start(parse_config({"model": "whisper_base"}), in_process=True)
    try:
        yield d
    finally:
        d.close()


def _decoder(d: Deployment):
    return d.runtime.workers.workers[0].engines["decoder"]


@pytest.fixture(scope="module")
def recorder(deployment: Deployment) -> Iterator[Recorder]:
    with record_batches(_decoder(deployment)) as rec:
        yield rec


def _spec(audio: bytes, variant: int, tag: str) -> TranscriptionSpec:
    language, prompt = VARIANTS[variant]
    # ids must never repeat within a deployment: a worker ignores tensors of released ids
    return TranscriptionSpec(f"{tag}-{uuid.uuid4().hex[:12]}", audio, "clip.wav", language=language,
                             prompt=prompt)


def _wait_drained(d: Deployment, timeout: float = 10.0) -> None:
    """Pages and cross-attention entries are released on the conductor's next plan after
    a request ends: poll."""
    engine = _decoder(d)
    held = engine.forward.cross_slots.held
    poll_drained(d, engine, also=lambda: held() == {}, timeout=timeout)
    conductor = d.runtime.conductor
    assert engine.pool.num_used_pages == 0, f"KV pages still held by {engine.pool.seq_ids()}"
    assert held() == {}, f"cross-attention KV still held for {list(held())}"
    assert engine.seqs == {}
    assert conductor.idle, f"waiting={len(conductor.waiting)} live={list(conductor.live)}"
    assert all(units == 0 for units in conductor.in_use.values()), conductor.in_use
    assert d.runtime.tracked == {}
    assert len(d.runtime.workers.workers[0].store) == 0
    engine.pool.check_invariants()


def _summary(t: Transcription) -> tuple:
    return t.text, t.language, [(s.start, s.end, s.text, tuple(s.tokens), s.temperature) for s in t.segments]


def test_concurrent_transcriptions_match_alone(deployment: Deployment, recorder: Recorder) -> None:
    d = deployment
    audio = CLIP.read_bytes()

    alone = [asyncio.run(d.backend.transcribe(_spec(audio, v, f"alone{v}"))) for v in range(len(VARIANTS))]
    for (language, prompt), result in zip(VARIANTS, alone):
        assert result.language == "en", (language, prompt, result)
        assert "quick brown fox" in result.text.lower(), (language, prompt, result.text)
    _wait_drained(d)

    mark = len(recorder.batches)
    variants = [i % len(VARIANTS) for i in range(CONCURRENT)]

    async def together() -> list[Transcription]:
        jobs = [d.backend.transcribe(_spec(audio, v, f"batch{i}")) for i, v in enumerate(variants)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

    batched = asyncio.run(together())
    for i, (variant, result) in enumerate(zip(variants, batched)):
        assert result.text == alone[variant].text, (i, VARIANTS[variant], result.text, alone[variant].text)
        assert _summary(result) == _summary(alone[variant]), (i, VARIANTS[variant])

    batches = recorder.batches[mark:]
    sizes = [len(b) for b in batches]
    print(f"\ndecoder batch sizes: {sizes}")
    assert max(sizes) > 1, f"the decoder never batched requests: {sizes}"
    prefills = [rid for b in batches for rid, op in b if op == "prefill"]
    assert len(prefills) == len(set(prefills)) == CONCURRENT  # one window each, prefilled once

    _wait_drained(d)
