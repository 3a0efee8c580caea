"""Fish S2-Pro's codec encoder (reference clips to codes, for cloning) against fish-speech
0.1.0's causal ``Encoder`` + ``DownsampleResidualVectorQuantize`` (the fixture
``record_codec_encoder.py`` wrote): the latents the books quantize within 1e-5 of their
peak, and the same codes; tiny random codec, fp32, CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.model.fish_s2_pro.codec import CodecConfig
from mstar.model.fish_s2_pro.codec_encoder import CodecEncoder, EncoderConfig
from mstar.model.fish_s2_pro.weights import codec_encoder_tensors

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "codec_encoder.pt")


def reference_encoder() -> CodecEncoder:
    encoder = CodecEncoder(EncoderConfig(**FIXTURE["encoder"]), CodecConfig(**FIXTURE["config"])).eval()
    encoder.load_state_dict(codec_encoder_tensors(FIXTURE["state_dict"], set(encoder.state_dict())), strict=True)
    return encoder


def test_codes_match_fish_speech():
    encoder = reference_encoder()
    with torch.no_grad():
        latents, codes = encoder.latents(FIXTURE["audio"]), encoder(FIXTURE["audio"])
    expected = FIXTURE["latents"]
    assert (latents - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert codes.shape == FIXTURE["codes"].shape == (2, 4, 20)
    assert torch.equal(codes, FIXTURE["codes"])


def test_a_clip_is_padded_to_whole_frames():
    encoder, audio = reference_encoder(), FIXTURE["audio"]
    with torch.no_grad():
        short = encoder(audio[:, :-3])  # the last frame's 3 samples missing: padded with zeros
    assert short.shape == (2, 4, 20)
    assert torch.equal(short[..., :-1], FIXTURE["codes"][..., :-1])  # causal: earlier frames unchanged


def test_unknown_encoder_tensor_is_named():
    encoder = reference_encoder()
    with pytest.raises(KeyError, match="encoder.extra"):
        codec_encoder_tensors({**FIXTURE["state_dict"], "encoder.extra": torch.zeros(1)}, set(encoder.state_dict()))
