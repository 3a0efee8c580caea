"""The conditioning cache (``ClipMemo`` behind ``VoiceCloning.clip_conditioning``): LRU
invariants under random use (entries and bytes), the byte size of a value, the memo off, and
three families wired through it: Qwen3-TTS Base (the x-vector), OmniVoice and Fish S2-Pro (the
clip's codes),
where a warm request equals a cold one bit for bit, another transcript of the same clip hits,
another clip misses and ``conditioning_cache_mib: 0`` encodes every time."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.config import ConfigError, parse_config
from mstar.contract import RequestError, SpeechSpec, VoiceClip
from mstar.model.registry import model_class
from mstar.model.voice_cloning import ClipMemo, size_of
from tests.support.fish_s2_pro import write_release as write_fish_release
from tests.support.omnivoice import write_tiny_release
from tests.support.qwen3_tts_dir import write_checkpoint

ops = st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 5), max_bytes=st.one_of(st.none(), st.integers(1, 100)), ops=ops)
def test_the_memo_keeps_the_lru_invariants(capacity: int, max_bytes: int | None, ops) -> None:
    """Against a plain model of an LRU: the same keys kept in the same order, a compute exactly
    on a miss, and the bounds held after every ask."""
    memo: ClipMemo[bytes] = ClipMemo(capacity, max_bytes)
    model: OrderedDict[str, int] = OrderedDict()
    for key_index, size in ops:
        key, computed = f"k{key_index}", []
        value = memo.get(key, lambda size=size, computed=computed: computed.append(1) or bytes(size))
        hit = key in model
        assert bool(computed) != hit
        if hit:
            model.move_to_end(key)
            assert len(value) == model[key]
        elif max_bytes is None or size <= max_bytes:
            model[key] = size
            while len(model) > capacity or (max_bytes is not None and sum(model.values()) > max_bytes):
                model.popitem(last=False)
        assert memo.keys() == list(model)
        assert memo.bytes == sum(model.values()) and len(memo) <= capacity
        assert max_bytes is None or memo.bytes <= max_bytes
    assert memo.hits + memo.misses == len(ops)


def test_eviction_by_size_and_a_value_too_big_to_keep() -> None:
    memo: ClipMemo[torch.Tensor] = ClipMemo(10, max_bytes=100)
    memo.get("a", lambda: torch.zeros(10))  # 40 bytes
    memo.get("b", lambda: torch.zeros(10))
    memo.get("a", lambda: torch.ones(10))  # a hit: "b" is now the oldest
    memo.get("c", lambda: torch.zeros(6))  # 104 bytes > 100: "b" goes
    assert memo.keys() == ["a", "c"] and memo.bytes == 64
    big = memo.get("d", lambda: torch.zeros(26))  # 104 bytes: returned, not kept, nothing evicted
    assert big.numel() == 26 and memo.keys() == ["a", "c"]
    assert memo.stats() == {"hits": 1, "misses": 4, "entries": 2, "bytes": 64}


@pytest.mark.parametrize(("capacity", "max_bytes"), [(0, None), (4, 0)])
def test_a_memo_of_no_room_is_off(capacity: int, max_bytes: int | None) -> None:
    memo: ClipMemo[int] = ClipMemo(capacity, max_bytes)
    calls: list[int] = []
    assert [memo.get("k", lambda: calls.append(1) or len(calls)) for _ in range(3)] == [1, 2, 3]
    assert not memo.enabled and len(memo) == 0 and (memo.hits, memo.misses) == (0, 3)
    with pytest.raises(ValueError):
        ClipMemo(-1)


def test_size_of_counts_tensors_arrays_and_text_through_containers() -> None:
    @dataclass
    class Value:
        codes: torch.Tensor
        text: str
        extra: dict

    value = Value(torch.zeros(2, 3, dtype=torch.int64), "hey", {"mel": np.zeros(4, np.float32), "n": 3})
    assert size_of(value) == 48 + 3 + 16 and size_of([torch.zeros(2), (torch.zeros(1, dtype=torch.float16),)]) == 10


# ----------------------------------------------------------------------------------- families
def sine(pitch: float, seconds: float = 0.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * pitch * t)).astype("<f4").tobytes()


def qwen3_base(root, mib: int | None = None):
    kwargs = {"max_new_frames": 30} if mib is None else {"max_new_frames": 30, "conditioning_cache_mib": mib}
    config = parse_config({"model": "qwen3_tts_base", "model_path": str(root), "load_format": "dummy",
                           "device": "cpu", "max_seq_len": 512,
                           "node_groups": [{"node_names": ["talker", "codec"], "ranks": [0]}], "model_kwargs": kwargs})
    spec = model_class("qwen3_tts_base")(config)
    spec.load_frontend()
    return spec


@pytest.fixture(scope="module")
def qwen3_root(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_tts_base"), "base")


def xvector(spec, pcm: bytes, text: str | None = None) -> torch.Tensor:
    request = spec.prepare_speech(SpeechSpec("r", "Hello there.", reference=VoiceClip(pcm, 16000, text),
                                             model_kwargs={"x_vector_only_mode": True}))
    return request.inputs["speaker_embed"]


def test_qwen3_tts_base_x_vectors_warm_equal_cold(qwen3_root) -> None:
    warm, cold = qwen3_base(qwen3_root), qwen3_base(qwen3_root, mib=0)
    assert warm.clip_memo.max_bytes == 64 << 20 and not cold.clip_memo.enabled
    first = xvector(warm, sine(150))
    again = xvector(warm, sine(150), text="Its transcript does not change the x-vector.")
    assert again is first and warm.clip_memo.stats()["hits"] == 1  # one encoding for both
    uncached = [xvector(cold, sine(150)) for _ in range(2)]
    assert uncached[0] is not uncached[1] and cold.clip_memo.misses == 2 and len(cold.clip_memo) == 0
    for tensor in uncached:
        assert torch.equal(tensor, first)  # bit for bit
    other = xvector(warm, sine(400))
    assert not torch.equal(other, first) and warm.clip_memo.misses == 2
    # each clip: its x-vector and its codes (0.5 s at 24 kHz: 250 frames of 4 int64 codes)
    assert warm.clip_memo.bytes == 2 * (first.numel() * 4 + 250 * 4 * 8)


def test_the_knob_is_typed_and_only_where_a_family_clones(qwen3_root) -> None:
    with pytest.raises(ConfigError, match="conditioning_cache_mib"):
        qwen3_base(qwen3_root, mib=-1)
    config = parse_config({"model": "qwen3_tts", "model_path": str(qwen3_root), "load_format": "dummy",
                           "device": "cpu", "node_groups": [{"node_names": ["talker", "codec"], "ranks": [0]}],
                           "model_kwargs": {"conditioning_cache_mib": 8}})
    with pytest.raises(ConfigError, match="conditioning_cache_mib"):
        model_class("qwen3_tts")(config)


@pytest.fixture(scope="module")
def omnivoice_release(tmp_path_factory):
    return write_tiny_release(tmp_path_factory.mktemp("omnivoice"))


def omnivoice(release, mib: int = 64):
    config = parse_config({"model": "omnivoice", "model_path": str(release), "device": "cpu", "dtype": "float32",
                           "load_format": "dummy", "node_groups": [{"node_names": ["canvas", "codec"], "ranks": [0]}],
                           "model_kwargs": {"seed": 3, "num_step": 4, "conditioning_cache_mib": mib}})
    spec = model_class("omnivoice")(config)
    spec.load_frontend()
    return spec


def canvas(spec, pcm: bytes, text: str | None) -> torch.Tensor:
    request = spec.prepare_speech(SpeechSpec("r", "Hello there.", voice="clone", reference=VoiceClip(pcm, 16000, text),
                                             model_kwargs={"seed": 1}))
    return request.inputs["canvas"]


def test_omnivoice_codes_warm_equal_cold_and_the_transcript_is_not_in_the_key(omnivoice_release) -> None:
    warm, cold = omnivoice(omnivoice_release), omnivoice(omnivoice_release, mib=0)
    first = canvas(warm, sine(150), "A short clip")
    assert torch.equal(canvas(warm, sine(150), "A short clip"), first) and warm.clip_memo.hits == 1
    assert torch.equal(canvas(cold, sine(150), "A short clip"), first)  # cold: encoded again, the same row
    assert cold.clip_memo.misses == 1 and len(cold.clip_memo) == 0
    retold = canvas(warm, sine(150), "Another transcript")
    assert warm.clip_memo.hits == 2 and not torch.equal(retold, first)  # the codes reused, the text new
    codes = warm.clip_prompt(VoiceClip(sine(150), 16000, "x")).codes  # a hit too
    start = retold.shape[1] - codes.shape[1] - int((retold == warm.model_config.audio_mask_id).all(0).sum())
    assert torch.equal(retold[:, start:start + codes.shape[1]], codes)  # the memoised codes, in the row
    assert warm.clip_memo.hits == 3
    assert not torch.equal(canvas(warm, sine(400), "A short clip"), first) and warm.clip_memo.misses == 2
    with pytest.raises(RequestError) as err:  # refused before any encoding
        canvas(warm, sine(500), None)
    assert err.value.field == "ref_text" and warm.clip_memo.misses == 2


@pytest.fixture(scope="module")
def fish_release(tmp_path_factory):
    return write_fish_release(tmp_path_factory.mktemp("fish_s2_pro"))


def fish(release, mib: int = 64):
    config = parse_config({"model": "fish_s2_pro", "model_path": str(release), "device": "cpu", "dtype": "float32",
                           "load_format": "dummy", "max_seq_len": 4608,
                           "node_groups": [{"node_names": ["dual_ar", "codec"], "ranks": [0]}],
                           "model_kwargs": {"conditioning_cache_mib": mib}})
    spec = model_class("fish_s2_pro")(config)
    spec.load_frontend()
    return spec


def fish_prompt(spec, pcm: bytes, text: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = spec.prepare_speech(SpeechSpec("r", "Hello there.", reference=VoiceClip(pcm, 16000, text))).inputs
    return inputs["prompt_ids"], inputs["prompt_codes"]


def test_fish_codes_warm_equal_cold_and_the_transcript_is_not_in_the_key(fish_release) -> None:
    warm, cold = fish(fish_release), fish(fish_release, mib=0)
    assert warm.clip_memo.max_bytes == 64 << 20 and not cold.clip_memo.enabled
    ids, codes = fish_prompt(warm, sine(150), "A short clip")
    again = fish_prompt(warm, sine(150), "A short clip")
    assert torch.equal(again[0], ids) and torch.equal(again[1], codes) and warm.clip_memo.hits == 1
    cold_ids, cold_codes = fish_prompt(cold, sine(150), "A short clip")  # encoded again: the same prompt
    assert torch.equal(cold_ids, ids) and torch.equal(cold_codes, codes)
    assert cold.clip_memo.misses == 1 and len(cold.clip_memo) == 0
    retold_ids, _ = fish_prompt(warm, sine(150), "Another transcript")
    assert warm.clip_memo.hits == 2 and not torch.equal(retold_ids, ids)  # the codes reused, the text new
    clip_codes = warm.clip_memo.get(warm.clip_memo.keys()[0], lambda: None)
    assert warm.clip_memo.bytes == clip_codes.numel() * clip_codes.element_size() > 0
    fish_prompt(warm, sine(400), "A short clip")
    assert warm.clip_memo.misses == 2 and len(warm.clip_memo) == 2
    with pytest.raises(RequestError) as err:  # refused before any encoding
        fish_prompt(warm, sine(500), None)
    assert err.value.field == "ref_text" and warm.clip_memo.misses == 2
