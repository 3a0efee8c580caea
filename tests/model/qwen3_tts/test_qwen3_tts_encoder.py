"""The 12 Hz tokenizer's encoder (``codec_encoder.py``) against the reference's ``encode``
(``fixtures/encoder.safetensors``, recorded by ``record_reference.py`` from ``qwen-tts==0.1.1``
under transformers 4.57.3: Mimi's encoder in a tiny random config, 4 of 8 codebooks kept, 24
samples per frame): the codes of two clips exactly, the quantizer's input within 1e-5; the
tokenizer's ``encoder.`` keys load with coverage both ways."""

from __future__ import annotations

import pytest
import torch

from mstar.model.qwen3_tts.checkpoint import encoder_names, load_codec_encoder
from mstar.model.qwen3_tts.codec_encoder import EncoderConfig, Qwen3TTSCodecEncoder
from mstar.model.weights import WeightLoadError
from tests.model.qwen3_tts.test_qwen3_tts_parity import TOL, read_fixture, rel_err


@pytest.fixture(scope="module")
def recorded() -> tuple[Qwen3TTSCodecEncoder, dict[str, torch.Tensor]]:
    config, weights, fx = read_fixture("encoder")
    encoder = Qwen3TTSCodecEncoder(EncoderConfig.from_hf_dict(config))
    load_codec_encoder(encoder, weights.items())
    return encoder.eval(), fx


@pytest.mark.parametrize("clip", [0, 1])
@torch.no_grad()
def test_codes_match_reference(recorded, clip: int) -> None:
    encoder, fx = recorded
    audio = fx[f"{clip}.clip"]
    assert rel_err(encoder.latents(audio[None])[0], fx[f"{clip}.latents"]) < TOL
    codes = encoder.encode(audio)
    assert codes.shape == (-(-len(audio) // 24), 4)  # ceil(samples / encode_downsample_rate) frames
    assert torch.equal(codes, fx[f"{clip}.codes"])
    assert all(len(c.unique()) > 1 for c in codes.T)  # a real test: every codebook varies


@torch.no_grad()
def test_encoding_is_causal(recorded) -> None:
    """A frame's codes depend only on the samples up to its end: a clip's first frames are
    those of its prefix (the tokenizer's convs pad on the left, the attention is causal)."""
    encoder, fx = recorded
    audio = fx["0.clip"]
    assert torch.equal(encoder.encode(audio[: 24 * 10]), encoder.encode(audio)[:10])


def test_config_and_key_coverage(recorded) -> None:
    config, weights, _ = read_fixture("encoder")
    cfg = EncoderConfig.from_hf_dict(config)
    assert (cfg.valid_quantizers, cfg.samples_per_frame, cfg.downsample_kernel) == (4, 24, 4)
    # the released config saves Mimi's frame rate as ``_frame_rate``; absent, Mimi derives it
    for enc in ({"_frame_rate": 12.5}, {"frame_rate": 12.5}, {}):
        released = EncoderConfig.from_hf_dict({"encoder_config": enc})
        assert (released.frame_rate or 12.5, released.downsample_kernel) == (12.5, 4)
        assert (released.valid_quantizers, released.samples_per_frame) == (16, 1920)
    assert EncoderConfig.from_hf_dict({"encoder_config": {"_frame_rate": 25.0}}).downsample_kernel == 0
    names = encoder_names(cfg)
    assert names("decoder.pre_conv.conv.weight") is None
    assert names("encoder.quantizer.acoustic_residual_vector_quantizer.layers.3.codebook.embed_sum") is None
    assert names("encoder.quantizer.acoustic_residual_vector_quantizer.layers.2.codebook.embed_sum") is not None
    fresh = Qwen3TTSCodecEncoder(cfg)
    with pytest.raises(WeightLoadError, match="downsample.conv.weight"):
        load_codec_encoder(fresh, [(k, v) for k, v in weights.items() if "downsample" not in k])
    with pytest.raises(WeightLoadError, match="encoder.encoder.layers.99"):
        load_codec_encoder(fresh, [*weights.items(), ("encoder.encoder.layers.99.conv.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="non-empty"):
        recorded[0].encode(torch.zeros(0))


def test_released_shapes() -> None:
    """At the released config (MimiConfig's defaults, 16 of 32 codebooks kept), built on the
    meta device: the released checkpoint's key names and shapes (a few of each kind), and its
    acoustic levels past the 15th and ``initialized`` flags dropped by the name map."""
    config = EncoderConfig.from_hf_dict({"encoder_config": {"_frame_rate": 12.5, "head_dim": 64}})
    with torch.device("meta"):
        encoder = Qwen3TTSCodecEncoder(config)
    state = {k: tuple(v.shape) for k, v in encoder.state_dict().items()}
    names = encoder_names(config)
    released = {"encoder.encoder.layers.0.conv.weight": (64, 1, 7), "encoder.encoder.layers.1.block.1.conv.weight":
                (32, 64, 3), "encoder.encoder.layers.3.conv.weight": (128, 64, 8),
                "encoder.encoder.layers.12.conv.weight": (1024, 512, 16),
                "encoder.encoder.layers.14.conv.weight": (512, 1024, 3),
                "encoder.downsample.conv.weight": (512, 512, 4),
                "encoder.encoder_transformer.layers.7.mlp.fc1.weight": (2048, 512),
                "encoder.encoder_transformer.layers.7.input_layernorm.bias": (512,),
                "encoder.quantizer.semantic_residual_vector_quantizer.input_proj.weight": (256, 512, 1),
                "encoder.quantizer.acoustic_residual_vector_quantizer.layers.14.codebook.embed_sum": (2048, 256),
                "encoder.quantizer.acoustic_residual_vector_quantizer.layers.14.codebook.cluster_usage": (2048,)}
    for name, shape in released.items():
        assert state[names(name)] == shape, name
    for dropped in ("encoder.quantizer.acoustic_residual_vector_quantizer.layers.15.codebook.embed_sum",
                    "encoder.quantizer.acoustic_residual_vector_quantizer.layers.30.codebook.cluster_usage",
                    "encoder.quantizer.semantic_residual_vector_quantizer.layers.0.codebook.initialized",
                    "encoder.quantizer.semantic_residual_vector_quantizer.output_proj.weight"):
        assert names(dropped) is None
    assert len([k for k in state if "codebook.embed_sum" in k]) == 16
