"""The cloning hook's parts on their own: the clip memo (an LRU keyed by content; one encoding
for concurrent asks; failures not remembered), the key (samples, rate, transcript if read, model), the
mixin's memoised ``clip_conditioning``, and presets read from a ``voices_dir``."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from mstar.contract import RequestError, Voice, VoiceClip
from mstar.model.voice_cloning import ClipMemo, VoiceCloning, VoicePresets, clip_key


def clip(values=(0.1, 0.2, 0.3), rate: int = 16000, text: str | None = None) -> VoiceClip:
    return VoiceClip(np.asarray(values, "<f4").tobytes(), rate, text)


def test_the_memo_is_an_lru_of_its_capacity():
    memo: ClipMemo[int] = ClipMemo(2)
    calls: list[str] = []

    def compute(key: str):
        return lambda: calls.append(key) or len(calls)

    assert memo.get("a", compute("a")) == 1 and memo.get("b", compute("b")) == 2
    assert memo.get("a", compute("a")) == 1  # a hit makes "a" the most recent
    memo.get("c", compute("c"))  # evicts "b", the least recently used
    assert "a" in memo and "b" not in memo and len(memo) == 2
    memo.get("b", compute("b"))
    assert calls == ["a", "b", "c", "b"] and (memo.hits, memo.misses) == (1, 4)


def test_concurrent_asks_for_one_key_compute_once():
    memo: ClipMemo[str] = ClipMemo(4)
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow() -> str:
        calls.append(1)
        started.set()
        release.wait(5)
        return "value"

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(memo.get, "k", slow) for _ in range(4)]
        started.wait(5)
        time.sleep(0.05)  # the other three are waiting on the first by now
        release.set()
        assert [f.result(5) for f in futures] == ["value"] * 4
    assert calls == [1]


def test_a_failed_encoding_is_not_remembered():
    memo: ClipMemo[int] = ClipMemo(2)

    def boom() -> int:
        raise RequestError("ref_audio", "too short")

    with pytest.raises(RequestError):
        memo.get("k", boom)
    assert "k" not in memo and memo.get("k", lambda: 7) == 7


def test_the_key_covers_samples_rate_transcript_and_model():
    base = clip_key("m", clip())
    assert clip_key("m", clip()) == base
    assert len({base, clip_key("m", clip((0.1, 0.2, 0.31))), clip_key("m", clip(rate=24000)),
                clip_key("m", clip(text="hi")), clip_key("m", clip(text="")), clip_key("other", clip())}) == 6
    untexted = clip_key("m", clip(text="hi"), with_text=False)
    assert untexted == clip_key("m", clip(text="bye"), with_text=False) == clip_key("m", clip(), with_text=False)
    assert untexted not in {base, clip_key("m", clip(text="unread")), clip_key("m", clip(text="none"))}


class Cloner(VoiceCloning):
    key = "cloner"
    clip_memo_size = 2

    def __init__(self) -> None:
        self.config = SimpleNamespace(model_path=None)
        self.seen: list[tuple[int, int, str | None]] = []

    def condition_on_clip(self, samples, sample_rate, ref_text):
        self.seen.append((samples.size, sample_rate, ref_text))
        return float(samples.sum())


def test_clip_conditioning_is_memoised_per_content():
    model = Cloner()
    assert model.clip_conditioning(clip()) == pytest.approx(0.6)
    assert model.clip_conditioning(clip()) == pytest.approx(0.6)
    model.clip_conditioning(clip(text="hi"))
    assert model.seen == [(3, 16000, None), (3, 16000, "hi")]
    assert model.clip_memo is model.clip_memo and model.clip_memo.capacity == 2
    assert Cloner().clip_memo is not model.clip_memo  # one memo per model instance


def test_presets_come_from_the_voices_dir(tmp_path):
    buf = io.BytesIO()
    sf.write(buf, np.full(1600, 0.25, np.float32), 16000, format="WAV", subtype="FLOAT")
    (tmp_path / "anna.wav").write_bytes(buf.getvalue())
    (tmp_path / "anna.txt").write_text(" Hello from Anna. \n")
    (tmp_path / "bert.flac").write_bytes(b"not audio at all")
    (tmp_path / "notes.md").write_text("ignored")
    presets = VoicePresets(tmp_path, "de")
    assert presets.names == ["anna", "bert"] and "anna" in presets and "notes" not in presets
    assert presets.voices() == [Voice("anna", "de", "preset"), Voice("bert", "de", "preset")]
    anna = presets.clip("anna")
    assert anna.text == "Hello from Anna." and anna.sample_rate == 16000 and anna.duration == pytest.approx(0.1)
    assert presets.clip("anna") is anna  # decoded once
    with pytest.raises(RequestError) as err:
        presets.clip("bert")
    assert err.value.field == "voice" and "unusable" in err.value.message
    with pytest.raises(RequestError, match="unknown voice 'carl'"):
        presets.clip("carl")
    with pytest.raises(ValueError, match="voices_dir"):
        VoicePresets(tmp_path / "missing")
