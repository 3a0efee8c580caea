"""The LTX-2 audio VAE's decoder: audio latents ``[B, 8, T, 16]`` -> a stereo mel spectrogram
``[B, 2, 4T - 3, 64]`` (time on the height axis, mel bins on the width).

Parameter names equal the ``decoder.*`` keys of diffusers' ``AutoencoderKLLTX2Audio`` (0.42.1)
plus the latent statistics, so a checkpoint's ``audio_vae/`` folder loads by name. The network
is a 2D convolutional decoder (residual blocks, nearest-neighbour 2x upsampling, optional
attention), its convolutions padded causally along one axis (``causality_axis``: all the
padding on the past side of time for ``height``), its norms weightless RMS over channels
(``pixel``) or group norms. The first 4x-upsampled latent frame gives one mel frame, so ``T``
latent frames give ``4T - 3`` mel frames.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LATENT_DOWNSAMPLE = 4  # mel frames per latent frame


@dataclass(frozen=True)
class LtxAudioVaeConfig:
    """The keys of diffusers' ``AutoencoderKLLTX2Audio`` ``config.json`` that shape the decoder."""

    base_channels: int = 128
    output_channels: int = 2
    ch_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] | None = None
    resolution: int = 256
    latent_channels: int = 8
    norm_type: str = "pixel"
    causality_axis: str | None = "height"
    mid_block_add_attention: bool = False
    sample_rate: int = 16000
    mel_hop_length: int = 160
    mel_bins: int | None = 64

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LtxAudioVaeConfig:
        """Build from a diffusers ``config.json`` dict; the encoder's keys are ignored."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "ch_mult" in kwargs:
            kwargs["ch_mult"] = tuple(kwargs["ch_mult"])
        if kwargs.get("attn_resolutions"):
            kwargs["attn_resolutions"] = tuple(kwargs["attn_resolutions"])
        config = cls(**kwargs)
        if config.norm_type not in ("pixel", "group"):
            raise ValueError(f"audio_vae config: norm_type {config.norm_type!r} must be 'pixel' or 'group'")
        if config.causality_axis not in (None, "none", "height", "width", "width-compatibility"):
            raise ValueError(f"audio_vae config: causality_axis {config.causality_axis!r} is not supported")
        return config

    @property
    def mel_frames_per_second(self) -> float:
        return self.sample_rate / self.mel_hop_length


class PixelNorm(nn.Module):
    """Weightless RMS norm over channels (no parameters, as diffusers' ``LTX2AudioPixelNorm``)."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x**2).mean(dim=1, keepdim=True) + self.eps)


def make_norm(kind: str, channels: int) -> nn.Module:
    return PixelNorm() if kind == "pixel" else nn.GroupNorm(32, channels, eps=1e-6)


class CausalConv2d(nn.Module):
    """A 2D convolution padded by hand: along ``axis`` all on the past side, elsewhere centred;
    ``None`` is a plain symmetric-padded convolution (weights directly on this module then)."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int, axis: str | None) -> None:
        super().__init__()
        pad = kernel - 1
        centred = (pad // 2, pad - pad // 2)
        if axis == "none":
            self.padding = (*centred, *centred)
        elif axis in ("width", "width-compatibility"):
            self.padding = (pad, 0, *centred)
        elif axis == "height":
            self.padding = (*centred, pad, 0)
        self.conv = nn.Conv2d(in_dim, out_dim, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding))


def make_conv(in_dim: int, out_dim: int, kernel: int, axis: str | None) -> nn.Module:
    if axis is None:
        return nn.Conv2d(in_dim, out_dim, kernel, padding=kernel // 2)
    return CausalConv2d(in_dim, out_dim, kernel, axis)


class ResnetBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, norm: str, axis: str | None) -> None:
        super().__init__()
        self.norm1 = make_norm(norm, in_dim)
        self.conv1 = make_conv(in_dim, out_dim, 3, axis)
        self.norm2 = make_norm(norm, out_dim)
        self.conv2 = make_conv(out_dim, out_dim, 3, axis)
        self.nin_shortcut = make_conv(in_dim, out_dim, 1, axis) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head attention over all (time, mel) positions with 1x1 convolution projections."""

    def __init__(self, dim: int, norm: str) -> None:
        super().__init__()
        self.norm = make_norm(norm, dim)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(dim, dim, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (proj(h).flatten(2).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return x + self.proj_out(out.transpose(1, 2).reshape(x.shape))


class Upsample(nn.Module):
    """Nearest 2x in both axes, a convolution, and (causal in time) the first new row dropped."""

    def __init__(self, dim: int, axis: str | None) -> None:
        super().__init__()
        self.axis = axis
        self.conv = make_conv(dim, dim, 3, axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        if self.axis == "height":
            return x[:, :, 1:]
        if self.axis == "width":
            return x[:, :, :, 1:]
        return x


class LtxAudioDecoder(nn.Module):
    def __init__(self, config: LtxAudioVaeConfig) -> None:
        super().__init__()
        c = self.config = config
        norm, axis, levels = c.norm_type, c.causality_axis, len(c.ch_mult)
        width = c.base_channels * c.ch_mult[-1]
        self.conv_in = make_conv(c.latent_channels, width, 3, axis)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(width, width, norm, axis)
        self.mid.attn_1 = AttnBlock(width, norm) if c.mid_block_add_attention else nn.Identity()
        self.mid.block_2 = ResnetBlock(width, width, norm, axis)
        stages: list[nn.Module] = []
        res = c.resolution // 2 ** (levels - 1)
        for level in reversed(range(levels)):
            stage = nn.Module()
            stage.block, stage.attn = nn.ModuleList(), nn.ModuleList()
            out = c.base_channels * c.ch_mult[level]
            for _ in range(c.num_res_blocks + 1):
                stage.block.append(ResnetBlock(width, out, norm, axis))
                width = out
                if c.attn_resolutions and res in c.attn_resolutions:
                    stage.attn.append(AttnBlock(width, norm))
            if level:
                stage.upsample = Upsample(width, axis)
                res *= 2
            stages.insert(0, stage)
        self.up = nn.ModuleList(stages)
        self.norm_out = make_norm(norm, width)
        self.conv_out = make_conv(width, c.output_channels, 3, axis)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``z [B, latent_channels, T, bins]`` (denormalised) -> mel ``[B, out, 4T - 3, mel_bins]``."""
        c = self.config
        frames = z.shape[2] * LATENT_DOWNSAMPLE
        if c.causality_axis is not None:
            frames = max(frames - (LATENT_DOWNSAMPLE - 1), 1)
        bins = c.mel_bins if c.mel_bins is not None else z.shape[3]
        x = self.mid.block_1(self.conv_in(z))
        x = self.mid.block_2(self.mid.attn_1(x))
        for level in reversed(range(len(c.ch_mult))):
            stage = self.up[level]
            for i, block in enumerate(stage.block):
                x = block(x)
                if len(stage.attn):
                    x = stage.attn[i](x)
            if level:
                x = stage.upsample(x)
        x = self.conv_out(F.silu(self.norm_out(x)))[:, :, :frames, :bins]
        return F.pad(x, (0, bins - x.shape[3], 0, frames - x.shape[2]))


class LtxAudioVae(nn.Module):
    """The decoder and the latent statistics (``latents_mean``/``latents_std`` over the packed
    ``channels x bins`` features)."""

    def __init__(self, config: LtxAudioVaeConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = LtxAudioDecoder(config)
        self.register_buffer("latents_mean", torch.zeros(config.base_channels))
        self.register_buffer("latents_std", torch.ones(config.base_channels))

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """The DiT's normalised audio tokens ``[B, T, C * bins]`` -> denormalised latents
        ``[B, C, T, bins]``."""
        x = tokens * self.latents_std.to(tokens) + self.latents_mean.to(tokens)
        return x.unflatten(2, (self.config.latent_channels, -1)).transpose(1, 2)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Normalised audio tokens -> mel spectrogram ``[B, out, frames, mel_bins]``."""
        return self.decoder(self.unpack(tokens))
