"""The decoder side of the Higgs Audio v2 tokenizer, OmniVoice's codec: codes -> 24 kHz audio.

Codes ``[B, C, T]`` (``C`` residual codebooks) become a latent by summing, per codebook, the
looked-up codeword (``codebook_dim`` wide) projected back to the RVQ width (``project_out``);
``fc2`` maps that to the DAC latent width and a DAC decoder upsamples it to a waveform: a k=7
conv, one block per upsampling ratio (Snake, a transposed conv of kernel ``2r``, stride ``r``,
padding ``ceil(r/2)`` and output padding ``r % 2``, then three residual units of dilation 1, 3
and 9: Snake, k=7 dilated conv, Snake, 1x1 conv, plus the input), a last Snake and a k=7 conv to
one channel. Unlike stock DAC there is no final tanh, and the odd output padding makes every
block upsample exactly ``r`` times, so ``T`` frames give ``T * hop_length`` samples.

Parameter names are transformers' ``HiggsAudioV2TokenizerModel`` ones (``quantizer.quantizers.
{i}.codebook.embed``, ``quantizer.quantizers.{i}.project_out``, ``fc2``, ``acoustic_decoder.*``);
convolutions hold plain weights (``checkpoint.py`` folds weight-normed ones). ``modeling.Codec``
puts this and the encoder side (``codec_encoder``) together.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mstar.model.omnivoice.config import CodecConfig


class Snake(nn.Module):
    """``x + sin(alpha * x)^2 / alpha`` with a learned per-channel ``alpha``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sin(self.alpha * x).pow(2) / (self.alpha + 1e-9)


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class UpsampleBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, ratio: int) -> None:
        super().__init__()
        self.snake1 = Snake(channels_in)
        self.conv_t1 = nn.ConvTranspose1d(channels_in, channels_out, 2 * ratio, stride=ratio,
                                          padding=math.ceil(ratio / 2), output_padding=ratio % 2)
        self.res_unit1 = ResidualUnit(channels_out, 1)
        self.res_unit2 = ResidualUnit(channels_out, 3)
        self.res_unit3 = ResidualUnit(channels_out, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class AcousticDecoder(nn.Module):
    """The DAC decoder stack (no final tanh)."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        width = config.decoder_hidden_size
        self.conv1 = nn.Conv1d(config.acoustic_hidden_size, width, 7, padding=3)
        self.block = nn.ModuleList(
            UpsampleBlock(width // 2**i, width // 2 ** (i + 1), r)
            for i, r in enumerate(config.upsampling_ratios)
        )
        out = width // 2 ** len(config.upsampling_ratios)
        self.snake1 = Snake(out)
        self.conv2 = nn.Conv1d(out, 1, 7, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class Codebook(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.register_buffer("embed", torch.zeros(config.codebook_size, config.codebook_dim))


class Quantizer(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.codebook = Codebook(config)
        self.project_in = nn.Linear(config.hidden_size, config.codebook_dim)
        self.project_out = nn.Linear(config.codebook_dim, config.hidden_size)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` ids -> ``[B, T, hidden]``."""
        return self.project_out(self.codebook.embed[codes])


class ResidualQuantizer(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(Quantizer(config) for _ in range(config.num_quantizers))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, C, T]`` -> the summed latent ``[B, T, hidden]`` of the first ``C`` stages."""
        if codes.shape[1] > len(self.quantizers):
            raise ValueError(f"{codes.shape[1]} codebooks given, the codec has {len(self.quantizers)}")
        return sum(q(codes[:, i]) for i, q in enumerate(self.quantizers[:codes.shape[1]]))
