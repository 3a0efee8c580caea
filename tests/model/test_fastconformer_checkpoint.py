"""The ``parakeet`` and ``nemotron_asr`` keys on checkpoints in transformers' layout, found in a
directory laid out like the hub cache: weights load with coverage checked both ways, a clip
served through the in-process runtime transcribes token for token as transformers' own
``generate`` does, and bad deployments or requests are refused naming the key or field."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import ParakeetFeatureExtractor
from transformers.models.nemotron_asr_streaming import NemotronAsrStreamingFeatureExtractor

from mstar.config import ConfigError, parse_config
from mstar.contract import RequestError, TranscriptionSpec
from mstar.model.fastconformer.checkpoint import TransducerCheckpoint
from mstar.model.registry import model_class
from mstar.model.weights import WeightLoadError
from mstar.runtime.launch import start
from tests.support.fastconformer import BLANK, REPOS, hub_cache, snapshot_dir, wav, write_parakeet


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return root, hub_cache(root)


def clip(seconds: float = 2.3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t)) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)



def reference_ids(model, features, **generate) -> list[int]:
    """transformers' greedy transcript of one clip (blanks left out)."""
    with torch.no_grad():
        out = model.generate(input_features=features["input_features"], attention_mask=features["attention_mask"],
                             decoder_start_token_id=BLANK, **generate)
    return [t for t in out.sequences[0, 1:].tolist() if t != BLANK]


def slots_used(d, timeout_s: float = 10.0) -> float:
    """The decoder's state slots in use once the runtime is idle (a request's release reaches
    the worker with the next plan)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = d.backend.gauges().get("rank0.decoder.transducer_slots_used")
        if (d.runtime.conductor.idle and used == 0) or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


def serve(key: str, root, **config):
    return start(parse_config({"model": key, "cache_dir": str(root), **config}), in_process=True)


@pytest.mark.parametrize("key", ["parakeet", "nemotron_asr"])
def test_hub_layout_serves_transcripts_equal_to_transformers(cache, key, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, refs = cache
    audio = clip()
    if key == "parakeet":
        features = ParakeetFeatureExtractor(feature_size=16)(audio, sampling_rate=16000, return_tensors="pt")
        want = reference_ids(refs[key], features)
        language = "de"
    else:
        extractor = NemotronAsrStreamingFeatureExtractor(feature_size=16, mel_filters_dtype="bfloat16")
        features = extractor(audio, sampling_rate=16000, return_tensors="pt")
        want = reference_ids(refs[key], features, prompt_ids=torch.tensor([9]), num_lookahead_tokens=13)
        language = "de"  # prompt 9, as the released dictionary has it
    assert want, "a degenerate random decode"
    d = serve(key, root, model_kwargs={"steps_per_iteration": 3})
    try:
        result = asyncio.run(d.backend.transcribe(TranscriptionSpec(f"{key}-1", wav(audio, "FLOAT"), "a.wav",
                                                                    language=language)))
        assert result.segments[0].tokens == want
        assert result.text == d.spec.tokenizer.decode(want, skip_special_tokens=True)
        assert slots_used(d) == 0  # the clip's state slot is back once the request ends
    finally:
        d.close()


def test_checkpoint_coverage_is_checked_both_ways(tmp_path):
    snapshot = snapshot_dir(tmp_path, REPOS["parakeet"])
    write_parakeet(snapshot)
    ckpt = TransducerCheckpoint.locate(str(snapshot))
    ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)  # loads as saved
    tensors = load_file(snapshot / "model.safetensors")
    extra = dict(tensors, **{"joint.extra.weight": torch.zeros(2)})
    save_file(extra, snapshot / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"joint\.extra\.weight"):
        ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    missing = {k: v for k, v in tensors.items() if k != "decoder.lstm.weight_hh_l1"}
    save_file(missing, snapshot / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"decoder\.lstm\.weight_hh_l1"):
        ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    # dummy weights never read the checkpoint's tensors
    model = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=True, seed=3)
    assert model.decoder.lstm.weight_hh_l1.shape == (4 * 24, 24)


def test_deployment_knobs_are_typed_and_checked(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _ = cache
    with pytest.raises(ConfigError, match=r"^model_kwargs.lookahed: unknown key.*lookahead"):
        model_class("nemotron_asr")(parse_config({"model": "nemotron_asr", "model_kwargs": {"lookahed": 6}}))
    with pytest.raises(ConfigError, match=r"^model_kwargs.lookahead: unknown key"):
        model_class("parakeet")(parse_config({"model": "parakeet", "model_kwargs": {"lookahead": 6}}))
    with pytest.raises(ConfigError, match=r"^model_kwargs.lookahead: must be one the checkpoint was trained with"):
        serve("nemotron_asr", root, model_kwargs={"lookahead": 5})
    with pytest.raises(ConfigError, match=r"resources.transducer_state.max_slots \(4, one of them the sink\) "
                                          r"cannot hold max_concurrent_requests \(8\)"):
        serve("parakeet", root, max_concurrent_requests=8, resources={"transducer_state": {"max_slots": 4}})
    with pytest.raises(ConfigError, match=r"^model_kwargs.cuda_graphs needs device: cuda"):
        model_class("parakeet")(parse_config({"model": "parakeet", "model_kwargs": {"cuda_graphs": True}}))
    with pytest.raises(ConfigError, match=r"^model_kwargs.cuda_graphs replays the device loop"):
        model_class("parakeet")(parse_config({"model": "parakeet", "device": "cuda",
                                              "model_kwargs": {"cuda_graphs": True, "device_loop": False}}))


def test_languages_are_checked_per_model(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _ = cache
    for key, good, bad in [("parakeet", ["en", "DE", None], ["ja", "en-us", "klingon"]),
                           ("nemotron_asr", ["en-us", "de", "auto", "pt-BR", None], ["xx", "en_US", "klingon"])]:
        spec = model_class(key)(parse_config({"model": key, "cache_dir": str(root)}))
        spec.load_frontend()
        for language in good:
            spec.language_prompt(language)
        for language in bad:
            with pytest.raises(RequestError) as err:
                spec.language_prompt(language)
            assert err.value.field == "language"
