"""A cloning request's clip and transcript to S2's in-prompt reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.audio.io import resample
from mstar.contract import RequestError
from mstar.model.fish_s2_pro.cloning import clip_reference
from mstar.model.fish_s2_pro.codec import CodecConfig
from mstar.model.fish_s2_pro.codec_encoder import CodecEncoder, EncoderConfig
from mstar.model.fish_s2_pro.weights import codec_encoder_tensors

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "codec_encoder.pt")


def encoder() -> CodecEncoder:
    module = CodecEncoder(EncoderConfig(**FIXTURE["encoder"]), CodecConfig(**FIXTURE["config"])).eval()
    module.load_state_dict(codec_encoder_tensors(FIXTURE["state_dict"], set(module.state_dict())))
    return module


def test_clip_is_resampled_and_encoded():
    enc = encoder()
    clip = np.random.default_rng(0).standard_normal(1100).astype(np.float32) * 0.3  # 1100 samples at 22.05 kHz
    ref = clip_reference(enc, clip, 22050, "  hello there ")
    assert ref.text == "hello there"
    at_rate = torch.from_numpy(resample(clip, 22050, 44100))
    with torch.no_grad():
        expected = enc(at_rate[None])[0]
    assert ref.codes.shape == (4, 2200 // 8 + (2200 % 8 > 0))
    assert torch.equal(ref.codes, expected)


@pytest.mark.parametrize(("text", "samples", "field"), [(None, 100, "ref_text"), ("  ", 100, "ref_text"),
                                                        ("hi", 0, "ref_audio"), ("hi", 44100 * 31, "ref_audio")])
def test_bad_clips_are_refused_naming_the_field(text, samples, field):
    with pytest.raises(RequestError) as err:
        clip_reference(encoder(), np.zeros(samples, dtype=np.float32), 44100, text)
    assert err.value.field == field and err.value.status == 400
