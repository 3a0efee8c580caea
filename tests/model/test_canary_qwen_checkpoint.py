"""The ``canary_qwen`` key on a tiny checkpoint in the released NeMo layout (the SALM snapshot
and the Qwen3 LLM it names, in a hub-cache directory): a clip served through the in-process
runtime (three at once) decodes token for token as a reference composed of transformers' modules does
(``ParakeetFeatureExtractor``, two ``ParakeetEncoder``s, the projection, the audio embeddings
spliced over the locator tag, ``Qwen3ForCausalLM.generate`` with the LoRA merged by hand);
weights load with coverage checked both ways; the real sizes' layout matches the reference
modules' on the meta device; bad deployments and requests are refused naming the key or field.

What could not be checked against the released files (Hugging Face is unreachable here): the
tensor names and config keys follow NeMo's source (``SALM``, ``AudioPerceptionModule``, PEFT's
LoRA wrapper, ``ConformerEncoder``), not a download of ``nvidia/canary-qwen-2.5b``."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import ParakeetFeatureExtractor

from mstar.config import ConfigError, parse_config
from mstar.contract import RequestError, TranscriptionSpec
from mstar.model.canary_qwen.checkpoint import CanaryQwenCheckpoint, our_name
from mstar.model.canary_qwen.config import CanaryQwenConfig
from mstar.model.canary_qwen.modeling import CanaryQwenModel
from mstar.model.registry import model_class
from mstar.model.weights import WeightLoadError, load_weights
from mstar.runtime.launch import start
from tests.support.fastconformer import (
    CANARY_QWEN_REPO,
    FrameLinear,
    canary_qwen_nemo_config,
    nemo_conformer,
    nemo_tensors,
    snapshot_dir,
    wav,
    write_canary_qwen,
)

MAX_NEW = 10
STOP = [2, 0]  # <|im_end|>, <|endoftext|>


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return root, write_canary_qwen(root)


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 180 * t * (1 + t)) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def reference(refs, tokenizer, audio: np.ndarray, instruction: str) -> list[int]:
    """The greedy transcript ids of the reference pipeline (with the end token, if reached)."""
    encoder, adapter, proj, llm = refs
    features = ParakeetFeatureExtractor(feature_size=16)(audio, sampling_rate=16000, return_tensors="pt")
    text = tokenizer.encode(f"<|im_start|>user\n{instruction} <|audioplaceholder|><|im_end|>\n"
                            "<|im_start|>assistant\n", add_special_tokens=False).ids
    locator = tokenizer.token_to_id("<|audioplaceholder|>")
    with torch.no_grad():
        encoded = encoder(features["input_features"], attention_mask=features["attention_mask"])
        adapted = adapter(encoded.last_hidden_state, attention_mask=encoded.attention_mask).last_hidden_state
        audio_embeds = proj(adapted)[0, :int(encoded.attention_mask.sum())]
        at = text.index(locator)
        embed = llm.get_input_embeddings()
        inputs = torch.cat([embed(torch.tensor(text[:at])), audio_embeds, embed(torch.tensor(text[at + 1:]))])
        out = llm.generate(inputs_embeds=inputs[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=STOP,
                           pad_token_id=0)
    tokens = out[0].tolist()
    ends = [i for i, t in enumerate(tokens) if t in STOP]
    return tokens[:ends[0] + 1] if ends else tokens


def deployment(root, **over) -> dict:
    return {"model": "canary_qwen", "cache_dir": str(root), "max_concurrent_requests": 4, "max_seq_len": 128,
            "resources": {"kv_cache": {"max_num_pages": 128, "page_size": 4}},
            "model_kwargs": {"max_new_tokens": MAX_NEW, "max_clip_seconds": 4.0}, **over}


def test_hub_layout_serves_transcripts_equal_to_the_reference(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, refs = cache
    d = start(parse_config(deployment(root)), in_process=True)
    try:
        audio = {"short": clip(2.1), "long": clip(3.3, seed=1)}
        asks = {"short": ("short", None), "long": ("long", None), "say": ("short", "Say what you hear .")}

        async def together() -> list:  # batched in the same steps
            return await asyncio.gather(*[d.backend.transcribe(TranscriptionSpec(
                f"cq-{name}", wav(audio[a], "FLOAT"), "a.wav", language="en" if name == "long" else None,
                prompt="ignored", model_kwargs={"instruction": i} if i else {})) for name, (a, i) in asks.items()])

        got = dict(zip(asks, asyncio.run(together())))
        tokenizer = d.spec.tokenizer
        want = {name: reference(refs, tokenizer, audio[a], i or "Transcribe the following:")
                for name, (a, i) in asks.items()}
        assert want["say"] != want["short"], "the instruction does not steer the random LLM"
        for name, result in got.items():
            assert result.segments[0].tokens == want[name], name
            assert result.text == tokenizer.decode(want[name], skip_special_tokens=True)
            assert result.language == "en"
        decoder = d.runtime.workers.workers[0].engines["decoder"]
        deadline = time.monotonic() + 10
        while decoder.pool.num_used_pages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decoder.pool.num_used_pages == 0

        # past max_clip_seconds (4 s): windows at quiet points, each decoded as alone, texts joined
        long = np.concatenate([clip(3.0, seed=2), np.zeros(8000, np.float32), clip(3.5, seed=3),
                               np.zeros(8000, np.float32), clip(2.5, seed=4)])
        windowed = asyncio.run(d.backend.transcribe(TranscriptionSpec("cq-win", wav(long, "FLOAT"), "a.wav")))
        assert len(windowed.segments) >= 3
        for segment in windowed.segments:
            assert segment.end - segment.start <= 4.0
            samples = long[int(round(segment.start * 16000)):int(round(segment.end * 16000))]
            assert segment.tokens == reference(refs, tokenizer, samples, "Transcribe the following:")
        assert windowed.text == " ".join(s.text for s in windowed.segments if s.text)
    finally:
        d.close()


def test_checkpoint_coverage_is_checked_both_ways(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _ = cache
    snapshot = snapshot_dir(root, CANARY_QWEN_REPO)
    ckpt = CanaryQwenCheckpoint.locate(str(snapshot), str(root))
    tensors = load_file(snapshot / "model.safetensors")
    try:
        for edit, error in [
            ({"perception.encoder.layers.0.extra": torch.zeros(1)}, r"perception\.encoder\.layers\.0\.extra"),
            ({"perception.modality_adapter.layers.1.self_attn.linear_v.bias": None},
             r"adapter\.layers\.1\.self_attn\.v_proj\.bias"),
            ({"llm.base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight": None},
             r"model\.layers\.1\.self_attn\.v_proj: a LoRA-wrapped layer without its B"),
            ({"embed_tokens.weight": None}, r"llm\.model\.embed_tokens\.weight")]:
            changed = {k: v for k, v in tensors.items() if edit.get(k, 0) is not None}
            changed.update({k: v for k, v in edit.items() if v is not None})
            save_file(changed, snapshot / "model.safetensors")
            with pytest.raises(WeightLoadError, match=error):
                ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    finally:
        save_file(tensors, snapshot / "model.safetensors")
    ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)


def test_real_size_layout_matches_the_reference_modules():
    """nvidia/canary-qwen-2.5b's sizes (as its config gives them: canary-1b-flash's encoder, a
    2-block adapter, Qwen3-1.7B with rank-128 LoRA on q and v): every tensor of the released
    layout, built from transformers' modules on the meta device, fills exactly our parameters."""
    from transformers import ParakeetEncoder, ParakeetEncoderConfig, Qwen3ForCausalLM
    from transformers import Qwen3Config as HFQwen3Config

    qwen = HFQwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=40960, rope_theta=1000000.0)
    encoder = nemo_conformer({}, feat_in=128, n_layers=32, d_model=1024, n_heads=8, ff_expansion_factor=4,
                             subsampling_conv_channels=256, conv_kernel_size=9, xscaling=False)
    adapter = nemo_conformer({}, feat_in=1024, n_layers=2, d_model=1024, n_heads=8, ff_expansion_factor=4,
                             subsampling_factor=1, conv_kernel_size=9, xscaling=True)
    nemo = canary_qwen_nemo_config()
    nemo["perception"].update(output_dim=2048, encoder=encoder, modality_adapter=adapter)
    nemo["perception"]["preprocessor"]["features"] = 128
    nemo["lora"].update(r=128, lora_alpha=256)
    with torch.device("meta"):
        ours = CanaryQwenModel(CanaryQwenConfig.from_nemo(nemo, qwen.to_dict()))
        hf_encoder = ParakeetEncoder(ParakeetEncoderConfig(hidden_size=1024, num_hidden_layers=32,
                                                           num_attention_heads=8, intermediate_size=4096,
                                                           num_mel_bins=128, subsampling_conv_channels=256,
                                                           conv_kernel_size=9, scale_input=False))
        hf_adapter = ParakeetEncoder(ParakeetEncoderConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                                                           intermediate_size=4096, num_mel_bins=1024,
                                                           subsampling_factor=1, conv_kernel_size=9))
        hf_adapter.subsampling = FrameLinear(1024)
        proj = torch.nn.Linear(1024, 2048)
        llm = Qwen3ForCausalLM(qwen)
        lora = {f"model.layers.{i}.self_attn.{p}": (torch.empty(128, 2048), torch.empty(w, 128))
                for i in range(28) for p, w in (("q_proj", 2048), ("v_proj", 1024))}
        tensors = nemo_tensors(hf_encoder, hf_adapter, proj, llm, lora)
    plain = {k: v for k, v in tensors.items() if ".lora_" not in k and ".base_layer." not in k}
    merged = {k.replace(".base_layer.", "."): v for k, v in tensors.items() if ".base_layer." in k}
    load_weights(ours, [(our_name(k, True), v) for k, v in (plain | merged).items()])  # both ways, shapes too
    assert sum(p.numel() for p in ours.parameters()) > 2e9  # a real size, not a toy


def test_kv_pool_seq_len_and_requests_are_checked(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _ = cache
    with pytest.raises(ConfigError, match=r"^resources.kv_cache.max_num_pages \(127\) cannot hold "
                                          r"max_concurrent_requests \(4\) requests of up to 32 pages"):
        model_class("canary_qwen")(parse_config(deployment(root, resources={"kv_cache": {
            "max_num_pages": 127, "page_size": 4}}))).default_capacity()
    with pytest.raises(ConfigError, match=r"^max_seq_len \(48\) cannot hold the prompt of a 4.0 s clip"):
        model_class("canary_qwen")(parse_config(deployment(root, max_seq_len=48))).load_frontend()
    with pytest.raises(ConfigError, match=r"^model_kwargs.target_language: unknown key"):
        model_class("canary_qwen")(parse_config(deployment(root, model_kwargs={"target_language": "fr"})))
    with pytest.raises(ConfigError, match=r"^model_kwargs.fused_kernels needs device: cuda"):
        model_class("canary_qwen")(parse_config(deployment(root, model_kwargs={"fused_kernels": True})))
    with pytest.raises(ConfigError, match=r"^model_kwargs.attention_backend: "):
        model_class("canary_qwen")(parse_config(deployment(root, model_kwargs={"attention_backend": "flash"})))
    spec = model_class("canary_qwen")(parse_config(deployment(root)))
    spec.load_frontend()
    for fields, field in [({"language": "de"}, "language"), ({"model_kwargs": {"language": "fr"}}, "language"),
                          ({"model_kwargs": {"instruction": ""}}, "instruction"),
                          ({"temperature": 0.4}, "temperature"), ({"task": "translate"}, "task"),
                          ({"model_kwargs": {"target_language": "en"}}, "model_kwargs")]:
        with pytest.raises(RequestError) as err:
            spec.instruction(TranscriptionSpec("x", b"", "a.wav", **fields))
        assert err.value.field == field, fields
    assert spec.instruction(TranscriptionSpec("x", b"", "a.wav", language="en", prompt="ignored")) == \
        "Transcribe the following:"
    with pytest.raises(RequestError) as err:
        spec.clip_request(torch.from_numpy(clip(1.0)), "w3 " * 120)
    assert err.value.field == "instruction"


@pytest.mark.parametrize("section,setting,error", [
    ("encoder", {"causal_downsampling": True}, r"perception\.encoder\.causal_downsampling"),
    ("encoder", {"conv_context_size": "causal"}, r"perception\.encoder\.conv_context_size"),
    ("encoder", {"att_context_size": [70, 13]}, r"perception\.encoder\.att_context_size"),
    ("encoder", {"untie_biases": False}, r"perception\.encoder\.untie_biases"),
    ("modality_adapter", {"subsampling_factor": 2, "subsampling_conv_channels": 8},
     r"perception\.modality_adapter\.subsampling_factor"),
    ("modality_adapter", {"feat_out": 48}, r"perception\.modality_adapter\.feat_out"),
    ("preprocessor", {"normalize": "all_features"}, r"perception\.preprocessor\.normalize")])
def test_nemo_settings_it_does_not_build_are_refused_naming_them(section: str, setting: dict, error: str) -> None:
    from tests.support.fastconformer import qwen_config

    nemo = canary_qwen_nemo_config()
    nemo["perception"][section].update(setting)
    with pytest.raises(NotImplementedError, match=error):
        CanaryQwenConfig.from_nemo(nemo, qwen_config().to_dict())
