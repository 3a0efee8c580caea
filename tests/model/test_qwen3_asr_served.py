"""The ``qwen3_asr`` key on a tiny checkpoint in the released layout (a hub-cache snapshot
with its tokenizer), real random weights: clips served through the in-process runtime, three
at once (language detected, forced, a context), decode token for token as transformers'
``Qwen3ASRFeatureExtractor`` + ``Qwen3ASRForConditionalGeneration.generate`` do on the same
prompt; the KV pages all come back."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import TranscriptionSpec
from mstar.runtime.launch import start
from tests.support.fastconformer import wav
from tests.support.qwen3_asr import AUDIO_TOKEN, MEL_BINS, reference, write_hub

MAX_NEW = 8
SEED = 7
SPREAD = 0.3


def clip(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 180 * t * (1 + t)) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def expected(ref, tokenizer, audio: np.ndarray, context: str, language: str | None, stop: list[int]) -> list[int]:
    """The reference's greedy ids (with the end token, if reached) for the SDK's prompt."""
    from transformers import Qwen3ASRFeatureExtractor
    from transformers.models.qwen3_asr.modeling_qwen3_asr import _get_feat_extract_output_lengths

    features = Qwen3ASRFeatureExtractor(feature_size=MEL_BINS)(audio, sampling_rate=16000, return_tensors="pt",
                                                              padding=True, return_attention_mask=True)
    mask = features["attention_mask"]
    rows = int(_get_feat_extract_output_lengths(mask.sum(-1))[0])

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = (ids(f"<|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n<|audio_start|>")
              + [AUDIO_TOKEN] * rows + ids("<|audio_end|><|im_end|>\n<|im_start|>assistant\n"
                                           + (f"language {language}<asr_text>" if language else "")))
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(input_ids=input_ids, input_features=features["input_features"], input_features_mask=mask,
                           attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_NEW, do_sample=False,
                           eos_token_id=stop, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    ends = [i for i, t in enumerate(tokens) if t in stop]
    return tokens[:ends[0] + 1] if ends else tokens


@pytest.mark.parametrize("fast", [{}, {"cuda_graphs": True, "overlap_scheduling": True}], ids=["eager", "fast"])
def test_served_transcripts_equal_the_reference(tmp_path, monkeypatch, fast) -> None:
    """``fast``: decode steps launched ahead and replayed through the graph path's buckets
    (eagerly here: the knob's CUDA check is lifted for the CPU)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("mstar.model.knobs.require_cuda", lambda key, device: None)
    write_hub(tmp_path, "Qwen/Qwen3-ASR-1.7B", seed=SEED, spread=SPREAD)
    config = {"model": "qwen3_asr", "cache_dir": str(tmp_path), "max_concurrent_requests": 4, "max_seq_len": 256,
              "resources": {"kv_cache": {"max_num_pages": 256, "page_size": 4}},
              "model_kwargs": {"max_new_tokens": MAX_NEW, "max_audio_seconds": 10.0, **fast}}
    d = start(parse_config(config), in_process=True)
    try:
        audio = {"short": clip(1.3, 1), "long": clip(9.5, 2)}  # 9.5 s: two attention windows (8 s each)
        asks = {"detect": ("long", "", None), "forced": ("short", "", "German"), "context": ("short", "w5 w6", None)}

        async def together() -> list:
            return await asyncio.gather(*[d.backend.transcribe(TranscriptionSpec(
                f"q-{name}", wav(audio[a], "FLOAT"), "a.wav", language="de" if lang else None, prompt=ctx or None))
                for name, (a, ctx, lang) in asks.items()])

        got = dict(zip(asks, asyncio.run(together())))
        ref = reference(SEED, SPREAD)
        want = {name: expected(ref, d.spec.tokenizer, audio[a], ctx, lang, d.spec.stop_ids)
                for name, (a, ctx, lang) in asks.items()}
        assert len({tuple(w) for w in want.values()}) == 3, "the asks do not steer the random model"
        for name in asks:
            assert got[name].segments[0].tokens == want[name], name
        assert got["forced"].language == "de"
        decoder = d.runtime.workers.workers[0].engines["decoder"]
        assert (decoder.graphs is not None) == fast.get("cuda_graphs", False)
        deadline = time.monotonic() + 10
        while decoder.pool.num_used_pages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decoder.pool.num_used_pages == 0
    finally:
        d.close()


@pytest.mark.parametrize("frames", [100, 130, 451, 800, 1])
def test_audio_rows_count_as_the_reference(frames: int) -> None:
    from transformers.models.qwen3_asr.modeling_qwen3_asr import _get_feat_extract_output_lengths

    from mstar.model.qwen3_asr.config import AuTConfig

    assert AuTConfig().positions(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))
