"""The served declaration: the dummy build at the release's shapes (on the meta device, nothing
allocated) has the parameter count the released config implies, and a misspelt knob stops
startup naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.config import ConfigError, parse_config
from mstar.model.fish_s2_pro.checkpoint import FishS2ProCheckpoint
from mstar.model.fish_s2_pro.codec import CodecConfig
from mstar.model.fish_s2_pro.config import DualARConfig
from mstar.model.registry import model_class

# fishaudio/s2-pro's config.json (the fields the model reads)
COMMON = {"dim": 2560, "head_dim": 128, "intermediate_size": 9728, "n_head": 32, "n_local_heads": 8,
          "norm_eps": 1e-6, "rope_base": 1_000_000, "attention_qkv_bias": False, "attention_o_bias": False}
RELEASED = {
    "model_type": "fish_qwen3_omni", "eos_token_id": 151645, "semantic_start_token_id": 151678,
    "semantic_end_token_id": 155773,
    "text_config": {**COMMON, "vocab_size": 155776, "n_layer": 36, "attention_qk_norm": True,
                    "tie_word_embeddings": True, "max_seq_len": 32768},
    "audio_decoder_config": {**COMMON, "vocab_size": 4096, "n_layer": 4, "num_codebooks": 10,
                             "attention_qk_norm": False, "max_seq_len": 11},
}


def expected_parameters(raw: dict) -> int:
    """The dual AR's parameters from the released numbers alone: per layer the fused q/k/v and
    output projections, the gated MLP and two norms (plus q/k norms where on); the slow AR's
    token and codebook embeddings (the head tied) and final norm; the fast AR's code
    embeddings, final norm and output head."""
    text, fast = raw["text_config"], raw["audio_decoder_config"]

    def layer(c: dict) -> int:
        q, kv = c["n_head"] * c["head_dim"], c["n_local_heads"] * c["head_dim"]
        norms = 2 * c["head_dim"] if c["attention_qk_norm"] else 0
        return c["dim"] * (q + 2 * kv) + q * c["dim"] + 3 * c["dim"] * c["intermediate_size"] + 2 * c["dim"] + norms

    slow = (text["vocab_size"] + fast["vocab_size"] * fast["num_codebooks"]) * text["dim"] + text["dim"]
    slow += text["n_layer"] * layer(text)
    head = 2 * fast["vocab_size"] * fast["dim"] + fast["dim"]
    return slow + head + fast["n_layer"] * layer(fast)


def test_dummy_build_at_released_shapes_counts_the_released_parameters(tmp_path: Path):
    config = DualARConfig.from_dict(RELEASED)
    model = FishS2ProCheckpoint(tmp_path).dual_ar(torch.device("meta"), torch.bfloat16, dummy=True, seed=0,
                                                  config=config)
    count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert count == expected_parameters(RELEASED)
    assert 4.5e9 < count < 4.6e9  # a Qwen3-4B slow AR (tied head) and a 4-layer fast AR
    assert (config.num_codebooks, config.codebook_size, config.semantic_begin_id) == (10, 4096, 151678)
    assert CodecConfig().n_codebooks + 1 == config.num_codebooks  # the release's codec reads every code


def config(**kwargs) -> dict:
    return {"model": "fish_s2_pro", "device": "cpu", "load_format": "dummy",
            "node_groups": [{"node_names": ["dual_ar", "codec"], "ranks": [0]}], **kwargs}


def test_unknown_knob_stops_startup_naming_it():
    cls = model_class("fish_s2_pro")
    with pytest.raises(ConfigError, match=r"model_kwargs\.max_new_frame\b.*max_new_frames"):
        cls(parse_config(config(model_kwargs={"max_new_frame": 8})))
    with pytest.raises(ConfigError, match=r"codec_chunk_schedule"):
        cls(parse_config(config(model_kwargs={"codec_chunk_schedule": [0, 2]})))
    spec = cls(parse_config(config(model_kwargs={"max_new_frames": 8})))
    assert spec.knobs.max_new_frames == 8
    assert set(spec.graph().nodes) == {"dual_ar", "codec"}


def test_the_shipped_yaml_parses_and_its_kv_pool_holds_every_request():
    from mstar.config import load_config

    deployment = load_config(Path(__file__).parents[3] / "configs" / "fish_s2_pro.yaml")
    spec = model_class("fish_s2_pro")(deployment)
    assert spec.knobs.max_new_frames == 2048 and set(spec.graph().walks) == {"tts"}
    kv = deployment.resources.kv_cache  # each request may hold max_seq_len positions from admission
    assert kv.max_num_pages * kv.page_size >= deployment.max_concurrent_requests * deployment.max_seq_len


def test_the_clip_memo_takes_its_bytes_from_conditioning_cache_mib():
    cls = model_class("fish_s2_pro")
    assert cls(parse_config(config())).clip_memo.max_bytes == 64 << 20
    spec = cls(parse_config(config(model_kwargs={"conditioning_cache_mib": 2})))
    assert spec.clip_memo.max_bytes == 2 << 20 and spec.clip_memo.enabled
    assert not cls(parse_config(config(model_kwargs={"conditioning_cache_mib": 0}))).clip_memo.enabled
    assert not cls.conditions_on_text  # one entry for a clip, whatever its transcript
