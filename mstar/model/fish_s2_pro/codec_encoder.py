"""Fish S2-Pro's codec encoder: a reference clip (44.1 kHz mono) to frames of codes, for
voice cloning.

The encode side of fish-speech's modded DAC, run once per clip (not streamed): the clip,
padded with zeros to whole frames, goes through a causal conv, ``encoder_rates`` blocks
(three residual units, Snake, a strided causal conv that doubles the width; the last
``encoder_transformer_layers`` of a block a window transformer of ``encoder_window``
frames), Snake and a causal conv to ``latent_dim``; then the quantizer's ``downsample``
(per factor a strided causal conv and a ConvNeXt block) and ``pre_module`` (the window
transformer the ``post_module`` mirrors). The codes are residual nearest neighbours: each
book projects the remaining residual by ``in_proj`` to ``codebook_dim``, takes the
codebook entry nearest in cosine (both sides L2-normalised), and subtracts that entry's
``out_proj``; the semantic book first, then the ``n_codebooks`` residual books.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.fish_s2_pro.codec import (
    CodecConfig,
    CodecState,
    ConvNeXtBlock,
    ResidualUnit,
    Snake1d,
    StreamSequential,
    WindowSpec,
    WindowTransformer,
    post_spec,
)


@dataclass
class EncoderConfig:
    """The release's encoder sizes by default (``modded_dac_vq.yaml``)."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 4)
    encoder_window: int = 512
    head_dim: int = 64  # the encoder blocks' transformers: width // 64 heads of this size


class StridedCausalConv(nn.Module):
    """fish-speech's ``CausalConvNet``: left padding ``reach + 1 - stride``, and on the right
    what completes the last stride."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation)
        self.span, self.stride = (kernel - 1) * dilation + 1, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.span - self.stride
        frames = math.ceil((x.shape[-1] - self.span + pad) / self.stride) + 1
        extra = (frames - 1) * self.stride + self.span - pad - x.shape[-1]
        return self.conv(F.pad(x, (pad, extra)))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int, layers: int, config: EncoderConfig, codec: CodecConfig) -> None:
        super().__init__()
        half = dim // 2
        parts: list[nn.Module] = [ResidualUnit(half, d) for d in (1, 3, 9)]
        parts += [Snake1d(half), StridedCausalConv(half, dim, 2 * stride, stride)]
        if layers:
            parts.append(WindowTransformer(WindowSpec(dim, layers, dim // 64, config.head_dim, dim * 3,
                                                      config.encoder_window, codec.rope_base, codec.norm_eps)))
        self.block = StreamSequential(*parts)

    def step(self, x: torch.Tensor, state: CodecState) -> torch.Tensor:
        return self.block.step(x, state)


class Encoder(nn.Module):
    def __init__(self, config: EncoderConfig, codec: CodecConfig) -> None:
        super().__init__()
        width = config.encoder_dim
        parts: list[nn.Module] = [StridedCausalConv(1, width, 7)]
        for stride, layers in zip(config.encoder_rates, config.encoder_transformer_layers, strict=True):
            width *= 2
            parts.append(EncoderBlock(width, stride, layers, config, codec))
        parts += [Snake1d(width), StridedCausalConv(width, codec.latent_dim, 3)]
        self.block = StreamSequential(*parts)


class QuantizeBook(nn.Module):
    def __init__(self, size: int, dim: int, width: int) -> None:
        super().__init__()
        self.in_proj = nn.Conv1d(width, dim, 1)
        self.codebook = nn.Embedding(size, dim)
        self.out_proj = nn.Conv1d(dim, width, 1)

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [B, T], the chosen entries' out_proj [B, width, T])``."""
        latents = F.normalize(self.in_proj(residual).transpose(1, 2), dim=-1)  # [B, T, dim]
        book = F.normalize(self.codebook.weight, dim=-1)
        distance = latents.pow(2).sum(-1, keepdim=True) - 2 * latents @ book.t() + book.pow(2).sum(-1)
        codes = distance.neg().argmax(dim=-1)
        return codes, self.out_proj(self.codebook(codes).transpose(1, 2))


class QuantizeBooks(nn.Module):
    def __init__(self, count: int, size: int, dim: int, width: int) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(QuantizeBook(size, dim, width) for _ in range(count))


class EncoderQuantizer(nn.Module):
    def __init__(self, codec: CodecConfig) -> None:
        super().__init__()
        c = codec
        self.downsample = StreamSequential(*(StreamSequential(StridedCausalConv(c.latent_dim, c.latent_dim, f, f),
                                                              ConvNeXtBlock(c.latent_dim))
                                             for f in c.downsample_factor))
        self.pre_module = WindowTransformer(post_spec(c))
        self.semantic_quantizer = QuantizeBooks(1, c.semantic_codebook_size, c.codebook_dim, c.latent_dim)
        self.quantizer = QuantizeBooks(c.n_codebooks, c.codebook_size, c.codebook_dim, c.latent_dim)


class CodecEncoder(nn.Module):
    """Audio ``[B, L]`` at the codec's rate to codes ``[B, 1 + n_codebooks, ceil(L / 2048)]``."""

    def __init__(self, config: EncoderConfig, codec: CodecConfig) -> None:
        super().__init__()
        self.codec = codec
        self.samples_per_frame = math.prod(config.encoder_rates) * math.prod(codec.downsample_factor)
        self.encoder = Encoder(config, codec)
        self.quantizer = EncoderQuantizer(codec)

    def latents(self, audio: torch.Tensor) -> torch.Tensor:
        """What the books quantize: ``[B, latent_dim, frames]``."""
        audio = F.pad(audio, (0, -audio.shape[-1] % self.samples_per_frame))[:, None]
        state = CodecState()  # the encode is one pass from the clip's start
        z = self.quantizer.downsample.step(self.encoder.block.step(audio, state), state)
        return self.quantizer.pre_module.step(z, state)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        z = self.latents(audio)
        codes = []
        for book in [*self.quantizer.semantic_quantizer.quantizers, *self.quantizer.quantizer.quantizers]:
            code, chosen = book(z)
            codes.append(code)
            z = z - chosen
        return torch.stack(codes, dim=1)
