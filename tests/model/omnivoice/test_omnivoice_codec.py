"""Our codec decoder against transformers' ``HiggsAudioV2TokenizerModel.decode`` (transformers
5.25; its module imports torchaudio, which decoding never calls, so an empty stand-in is
installed when it is missing): a tiny random tokenizer's decoder weights loaded by name."""

from __future__ import annotations

import pytest
import torch
from omnivoice_reference import hf_codec_config, stand_in_audio_io

from mstar.model.omnivoice import CodecDecoder, tiny_config


@pytest.fixture(scope="module")
def pair():
    stand_in_audio_io()
    from transformers import HiggsAudioV2TokenizerModel

    codec = tiny_config().codec
    torch.manual_seed(0)
    ref = HiggsAudioV2TokenizerModel(hf_codec_config(codec)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # unit-gain random weights, so the waveform stays near 1
        for name, t in ref.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=g)
            if name.endswith("alpha"):
                t.copy_(1 + 0.3 * noise)
            elif name.endswith("codebook.embed") or t.dim() < 2:
                t.copy_(noise if t.dim() == 2 else 0.1 * noise)
            else:
                t.copy_(noise * (t.shape[0] / t.numel()) ** 0.5)
    ours = CodecDecoder(codec).eval()
    wanted = set(ours.state_dict())
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if k in wanted}, strict=True)
    return ref, ours, codec


@pytest.mark.parametrize("rows", [4, 3])
@torch.no_grad()
def test_waveform_matches_transformers(pair, rows):
    ref, ours, codec = pair
    codes = torch.randint(0, codec.codebook_size, (2, rows, 9), generator=torch.Generator().manual_seed(rows))
    expected = ref.decode(codes, return_dict=False)[:, 0]
    got = ours(codes)
    assert got.shape == (2, 9 * codec.hop_length) == expected.shape
    err = float((got - expected).abs().max() / expected.abs().max())
    assert err <= 1e-4, err
    assert 0.1 < float(expected.abs().max()) < 1e3


@torch.no_grad()
def test_frames_decode_independently_of_the_batch(pair):
    _, ours, codec = pair
    codes = torch.randint(0, codec.codebook_size, (3, 4, 6), generator=torch.Generator().manual_seed(7))
    together = ours(codes)
    for i in range(3):
        alone = ours(codes[i:i + 1])[0]
        assert (alone - together[i]).abs().max() <= 1e-5 * together[i].abs().max()


def test_too_many_codebooks_are_refused(pair):
    _, ours, codec = pair
    with pytest.raises(ValueError, match="codebooks"):
        ours(torch.zeros(1, codec.num_quantizers + 1, 2, dtype=torch.long))
