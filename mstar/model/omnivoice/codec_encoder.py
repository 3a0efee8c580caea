"""The encoder half of the Higgs Audio v2 tokenizer: a reference clip -> codes ``[C, T]``.

Two views of the 24 kHz waveform are concatenated frame by frame and quantised:

- acoustic: a DAC encoder (a k=7 conv, one block per downsampling ratio of three residual
  units of dilation 1, 3, 9 at half width, then Snake and a strided conv of kernel ``2r``
  doubling the width, a last Snake and a k=3 conv to the latent width). When its frame count
  would differ from the semantic one, the input is first padded by half a hop on each side.
- semantic: the clip at 16 kHz, padded by 160 samples each side, through HuBERT; the mean of
  all its hidden states (the embedding output included), every ``semantic_stride``-th frame,
  then a small ELU conv net (``encoder_semantic``).

``fc`` mixes the concatenation and a residual VQ encodes it: each stage projects the residual
in (``project_in``), takes the nearest codeword (Euclidean), and subtracts that codeword's
projection back out (``project_out``).

HuBERT is transformers' ``HubertModel`` (public API, built from the tokenizer's own
``semantic_model_config``); the rest is ours. Names are transformers' tokenizer keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from mstar.model.omnivoice.codec import ResidualUnit, Snake
from mstar.model.omnivoice.config import CodecConfig


class DownsampleBlock(nn.Module):
    def __init__(self, channels_out: int, ratio: int) -> None:
        super().__init__()
        half = channels_out // 2
        self.res_unit1 = ResidualUnit(half, 1)
        self.res_unit2 = ResidualUnit(half, 3)
        self.res_unit3 = ResidualUnit(half, 9)
        self.snake1 = Snake(half)
        self.conv1 = nn.Conv1d(half, channels_out, 2 * ratio, stride=ratio, padding=math.ceil(ratio / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_unit3(self.res_unit2(self.res_unit1(x)))
        return self.conv1(self.snake1(x))


class AcousticEncoder(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        width = config.encoder_hidden_size
        self.conv1 = nn.Conv1d(1, width, 7, padding=3)
        self.block = nn.ModuleList(DownsampleBlock(width * 2 ** (i + 1), r)
                                   for i, r in enumerate(config.downsampling_ratios))
        out = width * 2 ** len(config.downsampling_ratios)
        self.snake1 = Snake(out)
        self.conv2 = nn.Conv1d(out, config.acoustic_hidden_size, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))

    def frames(self, samples: int) -> int:
        """Output length for ``samples`` input samples (every conv in order)."""
        for conv in self.modules():
            if isinstance(conv, nn.Conv1d):
                k, s, p, d = conv.kernel_size[0], conv.stride[0], conv.padding[0], conv.dilation[0]
                samples = (samples + 2 * p - d * (k - 1) - 1) // s + 1
        return samples


class ElUnit(nn.Module):
    """ELU -> dilated conv -> ELU -> 1x1 conv, plus the input (no biases)."""

    def __init__(self, channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2 * dilation,
                               dilation=dilation, bias=False)
        self.conv2 = nn.Conv1d(channels, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class SemanticBlock(nn.Module):
    def __init__(self, config: CodecConfig, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.res_units = nn.ModuleList(ElUnit(channels_in, config.unit_kernel_size, d)
                                       for d in config.block_dilations)
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(channels_in, channels_out, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        width = config.semantic_hidden_size
        self.conv = nn.Conv1d(width, width, config.kernel_size, padding=config.kernel_size // 2, bias=False)
        blocks, channels = [], width
        for ratio, stride in zip(config.channel_ratios, config.strides):
            blocks.append(SemanticBlock(config, channels, int(width * ratio), stride))
            channels = int(width * ratio)
        self.conv_blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


def hubert(config: CodecConfig) -> nn.Module:
    from transformers import HubertConfig, HubertModel

    fields = {k: v for k, v in config.semantic.items() if k not in ("model_type", "architectures")}
    model = HubertModel(HubertConfig(**fields))
    # Its positional conv is weight-normed; hold the plain weight (checkpoints fold the pair).
    conv = model.encoder.pos_conv_embed.conv
    if parametrize.is_parametrized(conv, "weight"):
        parametrize.remove_parametrizations(conv, "weight")
    return model


def semantic_features(model: nn.Module, wave_16k: torch.Tensor, stride: int) -> torch.Tensor:
    """``[B, samples]`` at 16 kHz -> ``[B, frames, hidden]``: the mean of HuBERT's hidden
    states over its layers, every ``stride``-th frame."""
    states = model(F.pad(wave_16k, (160, 160)), output_hidden_states=True).hidden_states
    features = torch.stack(states, dim=1).mean(dim=1)
    return features[:, ::stride] if stride > 1 else features


def nearest_codes(residual: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codeword ``[N, D]`` for each row of ``residual`` ``[..., D]``."""
    flat = residual.reshape(-1, residual.shape[-1])
    distance = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ embed.t() + embed.pow(2).sum(1)[None]
    return distance.argmin(-1).view(residual.shape[:-1])
