"""EarTTS's config from the released VoiceChat layout and its checkpoint's coverage."""

from __future__ import annotations

import pytest
import torch

from mstar.model.eartts.checkpoint import EarTTS, load_checkpoint
from mstar.model.eartts.config import EarTTSConfig
from mstar.model.weights import WeightLoadError
from tests.model.eartts.eartts_fixture import reference

RELEASED = {"model": {"speech_generation": {
    "model": {
        "inference_guidance_scale": 0.5,
        "codec_config": {"latent_size": 512, "n_fft": 16, "hop_length": 4, "base_hidden_size": 384,
                         "channel_mult": [1, 2, 4], "rates": [7, 7, 9], "num_blocks": 3, "kernel_size": 7,
                         "groups": 1, "codebook_size": 1024, "num_quantizers": 31, "wav_to_token_ratio": 1764},
        "tts_config": {"use_gated_fusion_for_text_audio": True, "disable_eos_prediction": True,
                       "use_audio_prompt_frozen_projection": True, "backbone_type": "gemma3_text",
                       "backbone_config": {"hidden_size": 1152, "intermediate_size": 4608, "num_hidden_layers": 28,
                                           "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 72},
                       "latent_size": 512, "codebook_size": 1024, "num_quantizers": 31, "context_hidden_size": None,
                       "mog_head_config": {"intermediate_size": 4608, "num_layers": 3, "low_rank": 64,
                                           "num_predictions": 1024, "min_log_std": -4.0, "eps": 1e-6},
                       "random_target_masking": False, "exponent": 3.0}},
    "data": {"frame_length": 0.08, "target_sample_rate": 22050, "audio_prompt_duration": 3.0}}}}


def test_released_config_layout():
    config = EarTTSConfig.from_speech_generation(RELEASED)
    talker, codec = config.talker, config.codec
    assert (talker.head_dim, talker.num_quantizers, talker.guidance_scale) == (72, 31, 0.5)
    assert talker.layer_types[5] == "full_attention" and talker.window(0) == 4096 and talker.window(5) is None
    assert (talker.theta(0), talker.theta(5)) == (10_000.0, 1_000_000.0)
    assert codec.decoder_channels == [1536, 768, 384] and codec.overlap == 12
    assert codec.wav_to_token_ratio / codec.sample_rate == pytest.approx(config.frame_length)
    # The codec state a session holds: each ConvNeXt block's last 6 inputs, ~95 KiB in bf16.
    elements = 3 * 6 * sum(codec.decoder_channels)
    assert elements * 2 / 1024 == pytest.approx(94.5)


def test_config_refuses_what_is_not_ported():
    bad = {**RELEASED["model"]["speech_generation"]["model"]["tts_config"], "context_hidden_size": 4096}
    with pytest.raises(ValueError, match="context_hidden_size"):
        EarTTSConfig.from_speech_generation({"model": {**RELEASED["model"]["speech_generation"]["model"],
                                                       "tts_config": bad}})


def _fresh():
    ref = reference()
    return ref, EarTTS(EarTTSConfig.from_speech_generation(ref["config"]), text_vocab=ref["text_on"].shape[0])


def test_checkpoint_covers_both_ways():
    ref, model = _fresh()
    extras = load_checkpoint(model, ref["state"].items())
    assert set(extras.speakers) == {"tiny"} and torch.equal(model.silence_codes, extras.silence)
    # The codec encoder, the EMA variances and other nodes' weights are not loaded.
    assert any(k.startswith("tts_model.audio_codec.encoder.") for k in ref["state"])
    assert any(k.startswith("tts_model.audio_codec.prvq._variance_list.") for k in ref["state"])

    ref, model = _fresh()
    missing = {k: v for k, v in ref["state"].items() if k != "tts_model.tts_model.mog_head.low_mat"}
    with pytest.raises(WeightLoadError, match="low_mat"):
        load_checkpoint(model, missing.items())

    ref, model = _fresh()
    extra = {**ref["state"], "tts_model.tts_model.lm_head.weight": torch.zeros(2, 64),
             "stt_model.llm.weight": torch.zeros(1)}
    with pytest.raises(WeightLoadError, match="lm_head"):
        load_checkpoint(model, extra.items())
