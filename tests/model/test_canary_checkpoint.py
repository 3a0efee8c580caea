"""The ``canary`` key on a checkpoint in transformers' layout, found in a directory laid out
like the hub cache: weights load with coverage checked both ways, a clip served through the
in-process runtime (transcription and translation prompts) decodes token for token as
transformers' own greedy ``generate`` does from the same prompt, and bad deployments or
requests are refused naming the key or field."""

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
from mstar.model.canary.checkpoint import CanaryCheckpoint
from mstar.model.registry import model_class
from mstar.model.weights import WeightLoadError
from mstar.runtime.launch import start
from tests.support.fastconformer import CANARY_REPO, snapshot_dir, wav, write_canary

MAX_NEW = 12
EOS = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return root, write_canary(snapshot_dir(root, CANARY_REPO))


def clip(seconds: float = 2.1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 180 * t * (1 + t)) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)



def reference(model, audio: np.ndarray, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (up to and with the end token)."""
    features = ParakeetFeatureExtractor(feature_size=16)(audio, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(input_features=features["input_features"], attention_mask=features["attention_mask"],
                             decoder_input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=EOS)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_hub_layout_serves_transcripts_equal_to_transformers(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, ref = cache
    d = start(parse_config({"model": "canary", "cache_dir": str(root), "max_concurrent_requests": 4,
                            "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 4}},
                            "model_kwargs": {"max_new_tokens": MAX_NEW}}), in_process=True)
    try:
        audio = clip()
        got = {}
        for name, spec in {"de": TranscriptionSpec("c-1", wav(audio, "FLOAT"), "a.wav", language="de"),
                           "de->en": TranscriptionSpec("c-2", wav(audio, "FLOAT"), "a.wav", task="translate",
                                                       model_kwargs={"language": "de"}),
                           "en->fr nopnc": TranscriptionSpec("c-3", wav(audio, "FLOAT"), "a.wav", model_kwargs={
                               "target_language": "fr", "punctuation": False})}.items():
            got[name] = asyncio.run(d.backend.transcribe(spec))
        prompt = d.spec.prompt
        want = {"de": reference(ref, audio, prompt("de", "de")),
                "de->en": reference(ref, audio, prompt("de", "en")),
                "en->fr nopnc": reference(ref, audio, prompt("en", "fr", punctuation=False))}
        assert len({tuple(w) for w in want.values()}) == 3, "the prompt does not steer the random decoder"
        for name, result in got.items():
            assert result.segments[0].tokens == want[name], name
            assert result.text == d.spec.tokenizer.decode(want[name], skip_special_tokens=True)
        assert got["de->en"].language == "en"
        decoder = d.runtime.workers.workers[0].engines["decoder"]
        deadline = time.monotonic() + 10
        while (decoder.pool.num_used_pages or decoder.forward.clips) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decoder.pool.num_used_pages == 0 and not decoder.forward.clips
    finally:
        d.close()


def test_checkpoint_coverage_is_checked_both_ways(tmp_path):
    snapshot = snapshot_dir(tmp_path, CANARY_REPO)
    write_canary(snapshot)
    ckpt = CanaryCheckpoint.locate(str(snapshot))
    ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    tensors = load_file(snapshot / "model.safetensors")
    save_file(dict(tensors, **{"model.decoder.extra": torch.zeros(1)}), snapshot / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"model\.decoder\.extra"):
        ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    name = "model.decoder.layers.1.encoder_attn.v_proj.bias"
    save_file({k: v for k, v in tensors.items() if k != name}, snapshot / "model.safetensors")
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)


def test_kv_pool_and_requests_are_checked(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _ = cache
    with pytest.raises(ConfigError, match=r"^resources.kv_cache.max_num_pages \(16\) cannot hold "
                                          r"max_concurrent_requests \(8\)"):
        model_class("canary")(parse_config({"model": "canary", "max_concurrent_requests": 8,
                                            "resources": {"kv_cache": {"max_num_pages": 16, "page_size": 16}},
                                            "model_kwargs": {"max_new_tokens": 100}})).default_capacity()
    with pytest.raises(ConfigError, match=r"^model_kwargs.lookahead: unknown key"):
        model_class("canary")(parse_config({"model": "canary", "model_kwargs": {"lookahead": 6}}))
    spec = model_class("canary")(parse_config({"model": "canary", "cache_dir": str(root)}))
    spec.load_frontend()
    for fields, field in [({"language": "ja"}, "language"), ({"model_kwargs": {"target_language": "xx"}},
                                                             "target_language"),
                          ({"language": "de", "model_kwargs": {"target_language": "fr"}}, "target_language"),
                          ({"task": "translate"}, "language"), ({"model_kwargs": {"punct": True}}, "model_kwargs")]:
        with pytest.raises(RequestError) as err:
            spec.options(TranscriptionSpec("x", b"", "a.wav", **fields))
        assert err.value.field == field, fields
