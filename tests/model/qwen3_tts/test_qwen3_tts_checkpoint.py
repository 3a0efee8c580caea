"""A Qwen3-TTS checkpoint in the released layout (``config.json`` + ``model.safetensors`` with
``talker.`` keys, ``speech_tokenizer/`` with the codec's config and ``encoder.``/``decoder.``
keys) built from the parity fixtures: the parts load with coverage both ways and match the
reference's outputs; the variant comes from the config; dummy weights need no tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
from mstar.model.qwen3_tts.config import Qwen3TTSConfig
from mstar.model.weights import WeightLoadError
from tests.model.qwen3_tts.test_qwen3_tts_parity import read_fixture, rel_err
from tests.support.pages import Pages


def write_checkpoint(root: Path, variant: str = "custom_voice", *, drop: str | None = None,
                     extra: bool = False) -> Path:
    talker_config, talker_weights, _ = read_fixture("talker_same_width")
    codec_config, codec_weights, _ = read_fixture("codec")
    (root / "speech_tokenizer").mkdir(parents=True)
    speaker_config, speaker_weights, _ = read_fixture("speaker")
    config = {"architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
              "tts_model_type": variant, "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": "0b6",
              "talker_config": talker_config, "speaker_encoder_config": speaker_config}
    (root / "config.json").write_text(json.dumps(config))
    weights = {k: v for k, v in talker_weights.items() if drop is None or drop not in k}
    if variant == "base":  # the speaker encoder's keys beside the talker's
        weights.update({k: v for k, v in speaker_weights.items() if drop is None or drop not in k})
    if extra:
        weights["talker.model.unused.weight"] = torch.zeros(2)
    save_file(weights, root / "model.safetensors")
    tokenizer_config, encoder_weights, _ = read_fixture("encoder")  # its decoder_config is the codec fixture's
    assert tokenizer_config["decoder_config"] == codec_config
    (root / "speech_tokenizer" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_tts_tokenizer_12hz", **tokenizer_config}))
    codec = dict(codec_weights, **{k: v for k, v in encoder_weights.items() if drop is None or drop not in k})
    save_file(codec, root / "speech_tokenizer" / "model.safetensors")
    return root


@torch.no_grad()
def test_released_layout_loads_and_matches(tmp_path: Path) -> None:
    checkpoint = Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path)))
    config = checkpoint.config()
    assert (config.tts_model_type, config.speakers, config.clones) == ("custom_voice", ["ryan", "vivian"], False)
    talker = checkpoint.talker("cpu", torch.float32, dummy=False, seed=0)
    _, _, fx = read_fixture("talker_same_width")
    layers, heads, head_dim = talker.cache_shape()
    caches = allocate_kv_cache(layers, 4, 4, heads, head_dim, torch.float32, "cpu")
    prefill = fx["0.prefill"]
    hidden = talker(prefill, Pages(4, 4).step([("0", len(prefill))]), caches)
    assert rel_err(talker.compute_logits(hidden[-1]), fx["0.logits"][0]) < 1e-5
    codec = checkpoint.codec("cpu", torch.float32, dummy=False, seed=0)
    _, _, codec_fx = read_fixture("codec")
    assert rel_err(codec(codec_fx["codes"]), codec_fx["wav"]) < 1e-4
    assert checkpoint.codec_config().output_sample_rate == 24000
    encoder = checkpoint.codec_encoder("cpu", torch.float32, dummy=False, seed=0)  # the decoder's keys are not its
    _, _, encoder_fx = read_fixture("encoder")
    assert torch.equal(encoder.encode(encoder_fx["0.clip"]), encoder_fx["0.codes"])


@torch.no_grad()
def test_base_checkpoint_loads_talker_and_speaker_encoder(tmp_path: Path) -> None:
    checkpoint = Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path / "ok", "base")))
    checkpoint.talker("cpu", torch.float32, dummy=False, seed=0)  # the speaker encoder's keys are not its
    encoder = checkpoint.speaker_encoder("cpu", torch.float32, dummy=False, seed=0)
    _, _, fx = read_fixture("speaker")
    assert rel_err(encoder.embed_clip(fx["clip"].numpy()), fx["embedding"]) < 1e-5
    broken = Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path / "broken", "base", drop="asp.conv")))
    with pytest.raises(WeightLoadError, match="asp.conv"):
        broken.speaker_encoder("cpu", torch.float32, dummy=False, seed=0)
    with pytest.raises(ValueError, match="no speaker encoder"):
        Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path / "cv"))).speaker_encoder(
            "cpu", torch.float32, dummy=True, seed=0)


@pytest.mark.parametrize("variant", ["voice_design", "base"])
def test_variant_from_config(tmp_path: Path, variant: str) -> None:
    config = Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path, variant))).config()
    assert config.tts_model_type == variant and config.speakers == [] and config.clones == (variant == "base")


def test_bad_variant_and_tokenizer_named() -> None:
    with pytest.raises(ValueError, match="tts_model_type"):
        Qwen3TTSConfig.from_hf_dict({"tts_model_type": "karaoke"})
    with pytest.raises(NotImplementedError, match="tokenizer_type"):
        Qwen3TTSConfig.from_hf_dict({"tokenizer_type": "qwen3_tts_tokenizer_25hz"})


def test_coverage_both_ways(tmp_path: Path) -> None:
    missing = Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path / "a", drop="codec_head")))
    with pytest.raises(WeightLoadError, match="codec_head"):
        missing.talker("cpu", torch.float32, dummy=False, seed=0)
    no_codebook = Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path / "c", drop="layers.2.codebook.embed")))
    with pytest.raises(WeightLoadError, match="layers.2.codebook.embed_sum"):
        no_codebook.codec_encoder("cpu", torch.float32, dummy=False, seed=0)
    extra = Qwen3TTSCheckpoint.locate(str(write_checkpoint(tmp_path / "b", extra=True)))
    with pytest.raises(WeightLoadError, match="talker.model.unused"):
        extra.talker("cpu", torch.float32, dummy=False, seed=0)


def test_dummy_weights_need_no_tensors(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path)
    (root / "model.safetensors").unlink()
    (root / "speech_tokenizer" / "model.safetensors").unlink()
    checkpoint = Qwen3TTSCheckpoint.locate(str(root), dummy=True)
    a = checkpoint.talker("cpu", torch.float32, dummy=True, seed=3)
    b = checkpoint.talker("cpu", torch.float32, dummy=True, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    codec = checkpoint.codec("cpu", torch.float32, dummy=True, seed=3)
    assert codec(torch.zeros(1, 4, 3, dtype=torch.long)).shape == (1, 3 * 48)
    encoder = checkpoint.codec_encoder("cpu", torch.float32, dummy=True, seed=3)
    codes = encoder.encode(torch.randn(24 * 9, generator=torch.Generator().manual_seed(0)))
    assert codes.shape == (9, 4) and len(codes.unique()) > 1  # drawn codebooks: not every code 0


def test_locate_names_missing_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="speech_tokenizer/config.json"):
        Qwen3TTSCheckpoint.locate(str(tmp_path))
