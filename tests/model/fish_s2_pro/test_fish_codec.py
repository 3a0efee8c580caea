"""Fish S2-Pro's causal codec decoder against fish-speech 0.1.0's modded DAC (the fixture
``record_codec.py`` wrote): the whole decode within 1e-4 of the peak on a tiny random codec
(fp32, CPU), and a stream of chunk decodes equal to the whole decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.model.fish_s2_pro.codec import CodecConfig, CodecDecoder, CodecState
from mstar.model.fish_s2_pro.weights import codec_tensors

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "codec.pt")


def reference_codec() -> CodecDecoder:
    codec = CodecDecoder(CodecConfig(**FIXTURE["config"])).eval()
    codec.load_state_dict(codec_tensors(FIXTURE["state_dict"], set(codec.state_dict())), strict=True)
    return codec


def test_whole_decode_matches_fish_speech():
    with torch.no_grad():
        audio = reference_codec().decode(FIXTURE["codes"])
    expected = FIXTURE["audio"]
    assert audio.shape == expected.shape == (2, 24 * 8)
    assert (audio - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("chunks", [[1] * 8 + [16], [3, 5, 1, 7, 8], [10, 14]])
def test_streamed_chunks_equal_whole_decode(chunks):
    codec, codes = reference_codec(), FIXTURE["codes"]
    state, pieces, start = CodecState(), [], 0
    with torch.no_grad():
        whole = codec.decode(codes)
        for size in chunks:
            pieces.append(codec.step(codes[..., start:start + size], state))
            start += size
    streamed = torch.cat(pieces, dim=-1)
    assert (streamed - whole).abs().max() <= 1e-4 * whole.abs().max()


def test_unknown_decoder_tensor_is_named():
    codec = CodecDecoder(CodecConfig(**FIXTURE["config"]))
    with pytest.raises(KeyError, match="decoder.extra"):
        codec_tensors({**FIXTURE["state_dict"], "decoder.extra": torch.zeros(1)}, set(codec.state_dict()))
