"""The ``higgs_audio`` key on a tiny checkpoint in the release's layout (a hub-cache snapshot
of ``bosonai/higgs-audio-v3-stt``): clips served through the in-process runtime (three at
once) decode token for token as a reference composed of transformers' modules does
(``WhisperFeatureExtractor`` per 0.5 s slice, ``WhisperEncoder``'s layers, the projector, the
embeddings between ``<|audio_bos|>`` and ``<|audio_eos|>``, ``Qwen3ForCausalLM.generate``);
weights load with coverage checked both ways; the real sizes' layout, built from the
reference modules on the meta device, fills exactly our parameters; bad deployments and
requests are refused naming the key or field.

What could not be checked (Hugging Face is unreachable here): the release's files
themselves and its own modeling and processor code; the key names, config keys, projector
and prompt follow public code that loads the checkpoint (docs/higgs_audio.md)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.config import ConfigError, parse_config
from mstar.contract import RequestError, TranscriptionSpec
from mstar.model.higgs_audio.checkpoint import HiggsAudioCheckpoint, our_name
from mstar.model.higgs_audio.config import HiggsAudioConfig
from mstar.model.higgs_audio.modeling import HiggsAudioModel
from mstar.model.registry import model_class
from mstar.model.weights import WeightLoadError, load_weights
from mstar.runtime.launch import start
from tests.support.fastconformer import snapshot_dir, wav
from tests.support.higgs_audio import (
    REPO,
    Projector,
    reference_transcript,
    release_config,
    release_tensors,
    write_higgs_audio,
)

MAX_NEW = 10
DEFAULT = "Transcribe the speech. Output only the spoken words in lowercase with no punctuation."


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return root, write_higgs_audio(root)


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 180 * t * (1 + t)) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def deployment(root, **over) -> dict:
    return {"model": "higgs_audio", "cache_dir": str(root), "max_concurrent_requests": 4, "max_seq_len": 128,
            "resources": {"kv_cache": {"max_num_pages": 128, "page_size": 4}},
            "model_kwargs": {"max_new_tokens": MAX_NEW, "max_clip_seconds": 4.0}, **over}


def test_hub_layout_serves_transcripts_equal_to_the_reference(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, refs = cache
    d = start(parse_config(deployment(root)), in_process=True)
    try:
        audio = {"short": clip(0.7), "long": clip(1.33, seed=1)}
        asks = {"short": ("short", None), "long": ("long", None), "say": ("short", "Say what you hear .")}

        async def together() -> list:  # batched in the same steps
            return await asyncio.gather(*[d.backend.transcribe(TranscriptionSpec(
                f"ha-{name}", wav(audio[a], "FLOAT"), "a.wav", language="en" if name == "long" else None,
                prompt="ignored", model_kwargs={"instruction": i} if i else {})) for name, (a, i) in asks.items()])

        got = dict(zip(asks, asyncio.run(together())))
        tokenizer = d.spec.tokenizer
        want = {name: reference_transcript(refs, tokenizer, audio[a], i or DEFAULT, MAX_NEW)
                for name, (a, i) in asks.items()}
        assert want["say"] != want["short"], "the instruction does not steer the random LLM"
        for name, result in got.items():
            assert result.segments[0].tokens == want[name], name
            assert result.text == tokenizer.decode(want[name], skip_special_tokens=True)
        assert got["long"].language == "en"
        decoder = d.runtime.workers.workers[0].engines["decoder"]
        deadline = time.monotonic() + 10
        while decoder.pool.num_used_pages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decoder.pool.num_used_pages == 0

        # past max_clip_seconds (4 s): windows at quiet points, each decoded as alone
        long = np.concatenate([clip(3.0, seed=2), np.zeros(8000, np.float32), clip(3.5, seed=3)])
        windowed = asyncio.run(d.backend.transcribe(TranscriptionSpec("ha-win", wav(long, "FLOAT"), "a.wav")))
        assert len(windowed.segments) >= 2
        for segment in windowed.segments:
            assert segment.end - segment.start <= 4.0
            samples = long[int(round(segment.start * 16000)):int(round(segment.end * 16000))]
            assert segment.tokens == reference_transcript(refs, tokenizer, samples, DEFAULT, MAX_NEW)
    finally:
        d.close()


def test_checkpoint_coverage_is_checked_both_ways(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _ = cache
    snapshot = snapshot_dir(root, REPO)
    ckpt = HiggsAudioCheckpoint.locate(str(snapshot), str(root))
    tensors = load_file(snapshot / "model.safetensors")
    try:
        for edit, error in [
            ({"audio_tower.layers.0.extra": torch.zeros(1)}, r"audio_tower\.layers\.0\.extra"),
            ({"audio_encoder_proj.temporal.bias": None}, r"audio_encoder_proj\.temporal\.bias"),
            ({"audio_decoder_proj.text_lm_head.weight": None}, r"llm\.lm_head\.weight"),
            ({"layers.1.self_attn.k_norm.weight": None}, r"llm\.model\.layers\.1\.self_attn\.k_norm\.weight")]:
            changed = {k: v for k, v in tensors.items() if edit.get(k, 0) is not None}
            changed.update({k: v for k, v in edit.items() if v is not None})
            save_file(changed, snapshot / "model.safetensors")
            with pytest.raises(WeightLoadError, match=error):
                ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    finally:
        save_file(tensors, snapshot / "model.safetensors")
    ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)


def test_real_size_layout_matches_the_reference_modules():
    """The release's sizes (Whisper-large-v3's encoder, a 1280 -> 2048 -> 2048 projector,
    Qwen3-1.7B with its own head): every tensor of the release's layout, built from the
    reference modules on the meta device, fills exactly our parameters."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    qwen = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                       max_position_embeddings=40960, rope_theta=1000000.0)
    whisper = WhisperConfig(num_mel_bins=128, d_model=1280, encoder_layers=32, encoder_attention_heads=20,
                            encoder_ffn_dim=5120, max_source_positions=1500)
    config = release_config()
    config["text_config"] = qwen.to_dict()
    config["audio_encoder_config"] = {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
                                      "encoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500}
    config.pop("projector_hidden_size")  # the LLM's width, 2048
    config["chunk_size_seconds"] = 4.0
    with torch.device("meta"):
        ours = HiggsAudioModel(HiggsAudioConfig.from_hf_dict(config))
        projector = Projector()
        projector.temporal = torch.nn.Conv1d(1280, 1280, 3, stride=2, padding=1, groups=1280)
        projector.linear1, projector.linear2 = torch.nn.Linear(1280, 2048), torch.nn.Linear(2048, 2048)
        tensors = release_tensors(WhisperEncoder(whisper), projector, Qwen3ForCausalLM(qwen))
    load_weights(ours, [(name, t) for k, t in tensors.items() if (name := our_name(k)) is not None])
    assert 2.5e9 < sum(p.numel() for p in ours.parameters()) < 2.9e9  # the card's 2.68B, give or take


def test_kv_pool_seq_len_and_requests_are_checked(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _ = cache
    with pytest.raises(ConfigError, match=r"^resources.kv_cache.max_num_pages \(127\) cannot hold "
                                          r"max_concurrent_requests \(4\) requests of up to 32 pages"):
        model_class("higgs_audio")(parse_config(deployment(root, resources={"kv_cache": {
            "max_num_pages": 127, "page_size": 4}}))).default_capacity()
    with pytest.raises(ConfigError, match=r"^max_seq_len \(48\) cannot hold the prompt of a 4.0 s clip"):
        model_class("higgs_audio")(parse_config(deployment(root, max_seq_len=48))).load_frontend()
    with pytest.raises(ConfigError, match=r"^model_kwargs.target_language: unknown key"):
        model_class("higgs_audio")(parse_config(deployment(root, model_kwargs={"target_language": "fr"})))
    with pytest.raises(ConfigError, match=r"^model_kwargs.fused_kernels needs device: cuda"):
        model_class("higgs_audio")(parse_config(deployment(root, model_kwargs={"fused_kernels": True})))
    spec = model_class("higgs_audio")(parse_config(deployment(root)))
    spec.load_frontend()
    for fields, field in [({"model_kwargs": {"instruction": ""}}, "instruction"),
                          ({"temperature": 0.4}, "temperature"), ({"task": "translate"}, "task"),
                          ({"model_kwargs": {"language": "en"}}, "model_kwargs")]:
        with pytest.raises(RequestError) as err:
            spec.instruction(TranscriptionSpec("x", b"", "a.wav", **fields))
        assert err.value.field == field, fields
    assert spec.instruction(TranscriptionSpec("x", b"", "a.wav", language="de", prompt="ignored")) == DEFAULT
    with pytest.raises(RequestError) as err:
        spec.clip_request(torch.from_numpy(clip(1.0)), "w3 " * 120)
    assert err.value.field == "instruction"
    # 4 s: eight 0.5 s slices of 50 frames, 6 embeddings each (25 conv frames, 12 pooled)
    assert spec.slice_frames(64000) == [50] * 8 and spec.audio_positions(4.0) == 8 * 6
    assert spec.slice_frames(8000 + 479) == [50] and spec.slice_frames(8000 + 480) == [50, 3]


@pytest.mark.parametrize("edit,error", [
    ({"projector_temporal_downsample": 4}, r"projector_temporal_downsample"),
    ({"audio_adapter_type": "linear"}, r"audio_adapter_type"),
    ({"skip_audio_tower": True}, r"skip_audio_tower"),
    ({"chunk_size_seconds": 1.0}, r"chunk_size_seconds")])
def test_settings_it_does_not_build_are_refused_naming_them(edit: dict, error: str) -> None:
    with pytest.raises((NotImplementedError, ValueError), match=error):
        HiggsAudioConfig.from_hf_dict(release_config() | edit)
