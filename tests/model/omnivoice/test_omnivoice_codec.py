"""Our codec against transformers' ``HiggsAudioV2TokenizerModel`` (transformers 5.25; its module
imports torchaudio, which this venv lacks: an empty stand-in is installed, and its one call,
the 24 -> 16 kHz resample in ``encode``, is given ours so that both sides see the same
samples): a tiny random tokenizer's weights loaded through our checkpoint's name map."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from omnivoice_reference import hf_codec_config, stand_in_audio_io

from mstar.audio.io import resample
from mstar.model.omnivoice import Codec, tiny_config
from mstar.model.omnivoice.checkpoint import codec_name, fold_weight_norm
from mstar.model.weights import load_weights


def ours_resample(wave: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    flat = wave.reshape(-1, wave.shape[-1])
    rows = [torch.from_numpy(resample(row.numpy(), orig_freq, new_freq)) for row in flat]
    return torch.stack(rows).view(*wave.shape[:-1], -1)


@pytest.fixture(scope="module")
def pair():
    stand_in_audio_io()
    from transformers.models.higgs_audio_v2_tokenizer import modeling_higgs_audio_v2_tokenizer as hm
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )

    codec = tiny_config().codec
    torch.manual_seed(0)
    ref = HiggsAudioV2TokenizerModel(hf_codec_config(codec)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # unit-gain random weights, so the waveform stays near 1
        for name, t in ref.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or name.startswith("semantic_model."):
                continue
            noise = torch.randn(t.shape, generator=g)
            if name.endswith("alpha"):
                t.copy_(1 + 0.3 * noise)
            elif name.endswith("codebook.embed") or t.dim() < 2:
                t.copy_(noise if t.dim() == 2 else 0.1 * noise)
            else:
                t.copy_(noise * (t.shape[0] / t.numel()) ** 0.5)
    ours = Codec(codec).eval()
    load_weights(ours, fold_weight_norm(ref.state_dict().items()), name_map=codec_name)
    saved = hm.torchaudio
    hm.torchaudio = types.SimpleNamespace(functional=types.SimpleNamespace(resample=ours_resample))
    yield ref, ours, codec
    hm.torchaudio = saved


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


@pytest.mark.parametrize("frames", [10, 13])
@torch.no_grad()
def test_codes_match_transformers(pair, frames):
    ref, ours, codec = pair
    g = torch.Generator().manual_seed(frames)
    wave = 0.3 * torch.randn(1, frames * codec.hop_length, generator=g)
    expected = ref.encode(wave[:, None], return_dict=False)
    semantic = torch.from_numpy(resample(wave[0].numpy(), codec.sample_rate, codec.semantic_sample_rate))[None]
    got = ours.encode(wave, semantic, codec.num_quantizers)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)
    # And the quantised latent they stand for decodes as theirs does.
    wave_out = ref.decode(expected, return_dict=False)[:, 0]
    assert (ours(got) - wave_out).abs().max() <= 1e-4 * wave_out.abs().max()
    assert np.unique(got.numpy()).size > 3


@torch.no_grad()
def test_frames_decode_independently_of_the_batch(pair):
    _, ours, codec = pair
    codes = torch.randint(0, codec.codebook_size, (3, 4, 6), generator=torch.Generator().manual_seed(7))
    together = ours(codes)
    for i in range(3):
        alone = ours(codes[i:i + 1])[0]
        # audio's tolerance (1e-4 of peak): a batch of 3 and of 1 take differently blocked
        # float32 products, 1e-5 of peak apart in a whole-suite run on 2 cores
        assert (alone - together[i]).abs().max() <= 1e-4 * together[i].abs().max()


def test_too_many_codebooks_are_refused(pair):
    _, ours, codec = pair
    with pytest.raises(ValueError, match="codebooks"):
        ours(torch.zeros(1, codec.num_quantizers + 1, 2, dtype=torch.long))
