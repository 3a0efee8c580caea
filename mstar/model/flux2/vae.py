"""The FLUX.2 VAE (images <-> 32-channel latents at 1/8 resolution) and the latent packing
FLUX.2 applies around its DiT.

``Flux2VAE`` mirrors diffusers' ``AutoencoderKLFlux2``: parameter and buffer names equal that
model's state dict keys, so a checkpoint's ``vae/`` weights load strictly by name. Architecture:
a convolutional encoder (ResNet blocks, stride-2 downsampling, a mid block with one single-head
spatial self-attention) producing mean and log-variance, 1x1 quant / post-quant convolutions, the
mirrored decoder (nearest 2x upsampling), and a non-affine ``BatchNorm2d`` over the *patchified*
latent channels whose running statistics normalise DiT tokens (it is never run as a layer).

Packing (VAE latent -> DiT tokens), as the FLUX.2 pipelines do it:
``[B, C, H, W]`` -> patchify 2x2 into channels ``[B, 4C, H/2, W/2]`` (channel ``4c + 2dy + dx``)
-> ``(x - bn_mean) / sqrt(bn_var + eps)`` -> row-major tokens ``[B, H/2 * W/2, 4C]``.
``unpack_latents`` inverts each step in reverse order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Flux2VAE",
    "Flux2VAEConfig",
    "from_tokens",
    "pack_latents",
    "patchify_latents",
    "to_tokens",
    "token_grid",
    "unpack_latents",
    "unpatchify_latents",
]

_EPS = 1e-6  # GroupNorm epsilon used throughout the encoder and decoder


@dataclass(frozen=True)
class Flux2VAEConfig:
    """Hyper-parameters; names follow diffusers' ``AutoencoderKLFlux2`` ``config.json``."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    decoder_block_out_channels: tuple[int, ...] | None = None
    layers_per_block: int = 2
    latent_channels: int = 32
    norm_num_groups: int = 32
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    batch_norm_eps: float = 1e-4
    batch_norm_momentum: float = 0.1
    patch_size: tuple[int, int] = (2, 2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Flux2VAEConfig:
        """Build from a diffusers ``config.json`` dict (``_``-prefixed metadata and unused keys such
        as ``sample_size`` / ``act_fn`` are ignored; block types must be the standard ones)."""
        if data.get("act_fn", "silu") != "silu":
            raise ValueError(f"unsupported act_fn {data['act_fn']!r}")
        for key, kind in (
            ("down_block_types", "DownEncoderBlock2D"),
            ("up_block_types", "UpDecoderBlock2D"),
        ):
            if any(t != kind for t in data.get(key, ())):
                raise ValueError(f"unsupported {key} {data[key]!r}")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("block_out_channels", "decoder_block_out_channels", "patch_size"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        return cls(**values)

    @property
    def scale_factor(self) -> int:
        """Pixels per latent cell along each side (8 for FLUX.2)."""
        return 2 ** (len(self.block_out_channels) - 1)


# --------------------------------------------------------------------------- building blocks


class _ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> conv3x3, twice, plus a (1x1-projected when widths differ) shortcut."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=_EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=_EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h


class _Downsample(nn.Module):
    """Pad right/bottom by one, then a stride-2 conv3x3 (halves H and W)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class _Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling, then conv3x3."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Stage(nn.Module):
    """A run of ResNet blocks, optionally followed by a down- or upsampler."""

    def __init__(self, cin: int, cout: int, layers: int, groups: int, resample: str | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            _ResnetBlock(cin if i == 0 else cout, cout, groups) for i in range(layers)
        )
        # diffusers keeps the resampler in a one-element list named after its direction.
        self._resampler_name: str | None = None
        if resample == "down":
            self.downsamplers = nn.ModuleList([_Downsample(cout)])
            self._resampler_name = "downsamplers"
        elif resample == "up":
            self.upsamplers = nn.ModuleList([_Upsample(cout)])
            self._resampler_name = "upsamplers"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self._resampler_name is not None:
            x = getattr(self, self._resampler_name)[0](x)
        return x


class _SpatialAttention(nn.Module):
    """Single-head self-attention over the H*W positions of a feature map, with a residual."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        seq = self.group_norm(x.reshape(b, c, h * w)).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(seq).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        out = self.to_out[0](out).transpose(1, 2).reshape(b, c, h, w)
        return x + out


class _MidBlock(nn.Module):
    """ResNet -> attention -> ResNet at the lowest resolution."""

    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([_SpatialAttention(channels, groups)] if attention else [])
        self.resnets = nn.ModuleList(_ResnetBlock(channels, channels, groups) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class _Encoder(nn.Module):
    def __init__(self, cfg: Flux2VAEConfig) -> None:
        super().__init__()
        chans, groups = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
        n, layers = len(chans), cfg.layers_per_block
        self.down_blocks = nn.ModuleList(
            _Stage(chans[max(i - 1, 0)], c, layers, groups, "down" if i < n - 1 else None)
            for i, c in enumerate(chans)
        )
        self.mid_block = _MidBlock(chans[-1], groups, cfg.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(groups, chans[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(chans[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class _Decoder(nn.Module):
    def __init__(self, cfg: Flux2VAEConfig) -> None:
        super().__init__()
        chans = list(reversed(cfg.decoder_block_out_channels or cfg.block_out_channels))
        groups = cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.latent_channels, chans[0], 3, padding=1)
        self.mid_block = _MidBlock(chans[0], groups, cfg.mid_block_add_attention)
        n, layers = len(chans), cfg.layers_per_block + 1
        self.up_blocks = nn.ModuleList(
            _Stage(chans[max(i - 1, 0)], c, layers, groups, "up" if i < n - 1 else None)
            for i, c in enumerate(chans)
        )
        self.conv_norm_out = nn.GroupNorm(groups, chans[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(chans[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


# --------------------------------------------------------------------------- the model


class Flux2VAE(nn.Module):
    """FLUX.2 autoencoder with diffusers ``AutoencoderKLFlux2`` parameter names."""

    def __init__(self, config: Flux2VAEConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or Flux2VAEConfig()
        self.encoder = _Encoder(cfg)
        self.decoder = _Decoder(cfg)
        lc = cfg.latent_channels
        self.quant_conv = nn.Conv2d(2 * lc, 2 * lc, 1) if cfg.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(lc, lc, 1) if cfg.use_post_quant_conv else None
        # Only its running statistics are used (by pack / unpack); it is never applied as a layer.
        self.bn = nn.BatchNorm2d(
            math.prod(cfg.patch_size) * lc,
            eps=cfg.batch_norm_eps,
            momentum=cfg.batch_norm_momentum,
            affine=False,
            track_running_stats=True,
        )

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in ``[-1, 1]`` -> posterior mean ``[B, C, H/8, W/8]``."""
        moments = self.encoder(images)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return moments[:, : self.config.latent_channels]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> images ``[B, 3, 8h, 8w]`` (nominally in ``[-1, 1]``)."""
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)

    def latent_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, std)`` per patchified latent channel, ``std = sqrt(running_var + eps)``."""
        mean, var = self.bn.running_mean, self.bn.running_var
        assert mean is not None and var is not None
        return mean, torch.sqrt(var + self.bn.eps)


# --------------------------------------------------------------------------- packing


def token_grid(height: int, width: int, scale_factor: int = 8) -> tuple[int, int]:
    """Token grid ``(rows, cols)`` the FLUX.2 pipeline uses for an ``height x width`` image
    (sizes are floored to a multiple of ``2 * scale_factor``); ``rows * cols`` is the image's
    sequence length."""
    return height // (2 * scale_factor), width // (2 * scale_factor)


def patchify_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, 4C, H/2, W/2]``; channel ``c * 4 + dy * 2 + dx``."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify_latents(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of ``patchify_latents``: ``[B, 4C, h, w]`` -> ``[B, C, 2h, 2w]``."""
    b, c4, h, w = latents.shape
    x = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c4 // 4, h * 2, w * 2)


def to_tokens(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> row-major tokens ``[B, h * w, C]`` (the pipeline's ``_pack_latents``)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def from_tokens(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Row-major tokens ``[B, height * width, C]`` -> ``[B, C, height, width]``."""
    b, n, c = tokens.shape
    if n != height * width:
        raise ValueError(f"{n} tokens do not fill a {height}x{width} grid")
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


def _stat(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, 1, 1).to(like.device, like.dtype)


def pack_latents(latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """VAE latents ``[B, C, H, W]`` -> normalised DiT tokens ``[B, H/2 * W/2, 4C]``.

    ``mean`` / ``std`` are per patchified channel (``Flux2VAE.latent_norm()``)."""
    x = patchify_latents(latents)
    return to_tokens((x - _stat(mean, x)) / _stat(std, x))


def unpack_latents(
    tokens: torch.Tensor, height: int, width: int, mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """DiT tokens on a ``height x width`` grid -> VAE latents ``[B, C, 2 * height, 2 * width]``."""
    x = from_tokens(tokens, height, width)
    return unpatchify_latents(x * _stat(std, x) + _stat(mean, x))
