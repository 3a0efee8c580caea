"""The LTX-2 video VAE's decoder: 128-channel latents -> RGB video, 32x larger in each side and
8x in time (``1 + 8k`` frames from ``1 + k`` latent frames).

Parameter names equal the ``decoder.*`` keys of diffusers' ``AutoencoderKLLTX2Video`` (0.42.1)
plus the two latent statistics, so a checkpoint's ``vae/`` folder loads by name (its encoder
keys are not ours: text-to-video never encodes). The maths follows it: every convolution is 3D
with its time padding made by repeating the edge frame (in front only when causal, both sides
otherwise), its space padding by reflection; norms are weightless RMS over channels; each up
block turns channels into a 2x2x2 finer grid (depth-to-space) plus a residual of the same
rearrangement, dropping the first new frame so the first latent frame stays one pixel frame.
The decoder may be conditioned on a decode time (``timestep_conditioning``): adaLN shifts and
scales in every residual block and before the last convolution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.ltx2_5.transformer import TimeEmbedder


def _tuple(value: Any, n: int) -> tuple:
    return (value,) * n if isinstance(value, (bool, int, str)) else tuple(value)


@dataclass(frozen=True)
class LtxVideoVaeConfig:
    """The keys of diffusers' ``AutoencoderKLLTX2Video`` ``config.json`` that shape the decoder."""

    latent_channels: int = 128
    out_channels: int = 3
    decoder_block_out_channels: tuple[int, ...] = (256, 512, 1024)
    decoder_layers_per_block: tuple[int, ...] = (5, 5, 5, 5)
    decoder_spatio_temporal_scaling: tuple[bool, ...] = (True, True, True)
    spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, True)  # the encoder's; sets the ratios
    upsample_type: tuple[str, ...] = ("spatiotemporal", "spatiotemporal", "spatiotemporal")
    upsample_residual: tuple[bool, ...] = (True, True, True)
    upsample_factor: tuple[int, ...] = (2, 2, 2)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    decoder_causal: bool = True
    decoder_spatial_padding_mode: str = "reflect"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LtxVideoVaeConfig:
        """Build from a diffusers ``config.json`` dict; the encoder's keys are ignored, a decoder
        option we do not implement raises, naming the key."""
        if any(_tuple(data.get("decoder_inject_noise", False), 1)):
            raise ValueError("vae config: decoder_inject_noise is not supported (only false)")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        blocks = len(kwargs.get("decoder_layers_per_block", cls.decoder_layers_per_block))
        for key in ("decoder_spatio_temporal_scaling", "upsample_residual"):
            if key in kwargs:
                kwargs[key] = _tuple(kwargs[key], blocks - 1)
        if "spatio_temporal_scaling" in kwargs:
            encoder_blocks = len(data.get("layers_per_block", (4, 6, 6, 2, 2)))
            kwargs["spatio_temporal_scaling"] = _tuple(kwargs["spatio_temporal_scaling"], encoder_blocks - 1)
        for key in ("decoder_block_out_channels", "decoder_layers_per_block", "upsample_type", "upsample_factor"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs)

    @property
    def spatial_ratio(self) -> int:
        """Pixels per latent cell along a side (diffusers derives it from the encoder's scaling
        unless the config states it)."""
        if self.spatial_compression_ratio is not None:
            return self.spatial_compression_ratio
        return self.patch_size * 2 ** sum(self.spatio_temporal_scaling)

    @property
    def temporal_ratio(self) -> int:
        if self.temporal_compression_ratio is not None:
            return self.temporal_compression_ratio
        return self.patch_size_t * 2 ** sum(self.spatio_temporal_scaling)


def channel_rms(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Weightless RMS norm over the channel axis of ``[B, C, F, H, W]``."""
    return x / torch.sqrt((x**2).mean(dim=1, keepdim=True) + eps)


class CausalConv3d(nn.Module):
    """A 3D convolution, space padded by ``padding_mode``, time padded with copies of the edge
    frame (``conv`` holds the weights, as diffusers' key path has it)."""

    def __init__(self, in_dim: int, out_dim: int, padding_mode: str, kernel: int = 3) -> None:
        super().__init__()
        self.kernel_t = kernel
        self.conv = nn.Conv3d(in_dim, out_dim, kernel, padding=(0, kernel // 2, kernel // 2),
                              padding_mode=padding_mode)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        if causal:
            x = torch.cat([x[:, :, :1].expand(-1, -1, self.kernel_t - 1, -1, -1), x], dim=2)
        else:
            side = (self.kernel_t - 1) // 2
            x = torch.cat([x[:, :, :1].expand(-1, -1, side, -1, -1), x, x[:, :, -1:].expand(-1, -1, side, -1, -1)],
                          dim=2)
        return self.conv(x)


class ResnetBlock(nn.Module):
    """norm, (adaLN), SiLU, conv; norm, (adaLN), SiLU, conv; plus the input (layer-normed and
    projected where the width changes)."""

    def __init__(self, in_dim: int, out_dim: int, eps: float, padding_mode: str, timed: bool) -> None:
        super().__init__()
        self.conv1 = CausalConv3d(in_dim, out_dim, padding_mode)
        self.conv2 = CausalConv3d(out_dim, out_dim, padding_mode)
        self.norm3 = self.conv_shortcut = None
        if in_dim != out_dim:
            self.norm3 = nn.LayerNorm(in_dim, eps=eps)
            self.conv_shortcut = nn.Conv3d(in_dim, out_dim, 1)
        self.scale_shift_table = nn.Parameter(torch.randn(4, in_dim) / in_dim**0.5) if timed else None

    def forward(self, x: torch.Tensor, time: torch.Tensor | None, causal: bool) -> torch.Tensor:
        h = channel_rms(x)
        if self.scale_shift_table is not None:
            mods = time.unflatten(1, (4, -1)) + self.scale_shift_table[None, :, :, None, None, None]
            shift1, scale1, shift2, scale2 = mods.unbind(1)
            h = h * (1 + scale1) + shift1
        h = self.conv1(F.silu(h), causal)
        h = channel_rms(h)
        if self.scale_shift_table is not None:
            h = h * (1 + scale2) + shift2
        h = self.conv2(F.silu(h), causal)
        if self.norm3 is not None:
            x = self.conv_shortcut(self.norm3(x.movedim(1, -1)).movedim(-1, 1))
        return h + x


def depth_to_space(x: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    """``[B, C * st * sh * sw, F, H, W]`` -> ``[B, C, F * st - (st - 1), H * sh, W * sw]``: the
    channel groups become the finer grid; the first ``st - 1`` new frames are dropped."""
    b, _, f, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(b, -1, st, sh, sw, f, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, -1, f * st, h * sh, w * sw)[:, :, st - 1:]


class Upsampler(nn.Module):
    """A convolution to ``stride``-product times the width (over ``factor``), then depth to
    space; with ``residual`` the input's own depth-to-space, channel-repeated, is added."""

    def __init__(self, dim: int, stride: tuple[int, int, int], residual: bool, factor: int,
                 padding_mode: str) -> None:
        super().__init__()
        self.stride, self.residual = stride, residual
        self.repeats = stride[0] * stride[1] * stride[2] // factor
        self.conv = CausalConv3d(dim, dim * self.repeats, padding_mode)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        out = depth_to_space(self.conv(x, causal), self.stride)
        if self.residual:
            out = out + depth_to_space(x, self.stride).repeat(1, self.repeats, 1, 1, 1)
        return out


STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, layers: int, eps: float, scale: bool, kind: str,
                 residual: bool, factor: int, padding_mode: str, timed: bool) -> None:
        super().__init__()
        self.time_embedder = _time_embedder(4 * in_dim) if timed else None
        self.conv_in = ResnetBlock(in_dim, out_dim, eps, padding_mode, timed) if in_dim != out_dim else None
        self.upsamplers = None
        if scale:
            self.upsamplers = nn.ModuleList(
                [Upsampler(out_dim * factor, STRIDES[kind], residual, factor, padding_mode)])
        self.resnets = nn.ModuleList(ResnetBlock(out_dim, out_dim, eps, padding_mode, timed) for _ in range(layers))

    def forward(self, x: torch.Tensor, t: torch.Tensor | None, causal: bool) -> torch.Tensor:
        if self.conv_in is not None:
            x = self.conv_in(x, t, causal)  # diffusers hands this block the raw time
        time = _embed_time(self.time_embedder, t, x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, causal)
        for resnet in self.resnets:
            x = resnet(x, time, causal)
        return x


class MidBlock(nn.Module):
    def __init__(self, dim: int, layers: int, eps: float, padding_mode: str, timed: bool) -> None:
        super().__init__()
        self.time_embedder = _time_embedder(4 * dim) if timed else None
        self.resnets = nn.ModuleList(ResnetBlock(dim, dim, eps, padding_mode, timed) for _ in range(layers))

    def forward(self, x: torch.Tensor, t: torch.Tensor | None, causal: bool) -> torch.Tensor:
        time = _embed_time(self.time_embedder, t, x)
        for resnet in self.resnets:
            x = resnet(x, time, causal)
        return x


def _time_embedder(dim: int) -> nn.Module:
    """PixArt-alpha's timestep embedder under diffusers' ``time_embedder.timestep_embedder`` keys."""
    holder = nn.Module()
    holder.timestep_embedder = TimeEmbedder(dim)
    return holder


def _embed_time(embedder: nn.Module | None, t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    if embedder is None:
        return None
    return embedder.timestep_embedder(t.flatten(), x.dtype).view(x.shape[0], -1, 1, 1, 1)


class LtxVideoDecoder(nn.Module):
    """Latents ``[B, 128, 1 + k, h, w]`` -> video ``[B, 3, 1 + 8k, 32h, 32w]`` in [-1, 1]."""

    def __init__(self, config: LtxVideoVaeConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        pad, eps, timed = c.decoder_spatial_padding_mode, c.resnet_norm_eps, c.timestep_conditioning
        channels = tuple(reversed(c.decoder_block_out_channels))
        layers = tuple(reversed(c.decoder_layers_per_block))
        scaling = tuple(reversed(c.decoder_spatio_temporal_scaling))
        residual = tuple(reversed(c.upsample_residual))
        factors = tuple(reversed(c.upsample_factor))
        width = channels[0]
        self.conv_in = CausalConv3d(c.latent_channels, width, pad)
        self.mid_block = MidBlock(width, layers[0], eps, pad, timed)
        self.up_blocks = nn.ModuleList()
        for i, out in enumerate(channels):
            in_dim, width = width // factors[i], out // factors[i]
            self.up_blocks.append(UpBlock(in_dim, width, layers[i + 1], eps, scaling[i], c.upsample_type[i],
                                          residual[i], factors[i], pad, timed))
        self.conv_out = CausalConv3d(width, c.out_channels * c.patch_size**2, pad)
        if timed:
            self.timestep_scale_multiplier = nn.Parameter(torch.tensor(1000.0))
            self.time_embedder = _time_embedder(2 * width)
            self.scale_shift_table = nn.Parameter(torch.randn(2, width) / width**0.5)

    def forward(self, z: torch.Tensor, t: torch.Tensor | None = None, causal: bool | None = None) -> torch.Tensor:
        """``z`` the denormalised latents; ``t [B]`` the decode time (timestep-conditioned
        decoders only); ``causal`` defaults to the config's ``decoder_causal``."""
        causal = causal or self.config.decoder_causal
        x = self.conv_in(z, causal)
        if self.config.timestep_conditioning:
            if t is None:
                raise ValueError("this VAE decoder is timestep-conditioned: give the decode time")
            t = t * self.timestep_scale_multiplier
        x = self.mid_block(x, t, causal)
        for block in self.up_blocks:
            x = block(x, t, causal)
        x = channel_rms(x)
        if self.config.timestep_conditioning:
            mods = _embed_time(self.time_embedder, t, x).unflatten(1, (2, -1))
            shift, scale = (mods + self.scale_shift_table[None, :, :, None, None, None]).unbind(1)
            x = x * (1 + scale) + shift
        x = self.conv_out(F.silu(x), causal)
        b, _, f, h, w = x.shape
        p, pt = self.config.patch_size, self.config.patch_size_t
        x = x.reshape(b, -1, pt, p, p, f, h, w).permute(0, 1, 5, 2, 6, 4, 7, 3)
        return x.reshape(b, -1, f * pt, h * p, w * p)


class LtxVideoVae(nn.Module):
    """The decoder and the latent statistics (``latents_mean``/``latents_std`` buffers)."""

    def __init__(self, config: LtxVideoVaeConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = LtxVideoDecoder(config)
        self.register_buffer("latents_mean", torch.zeros(config.latent_channels))
        self.register_buffer("latents_std", torch.ones(config.latent_channels))

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT's normalised latents ``[B, C, F, H, W]`` -> the decoder's scale."""
        view = (1, -1, 1, 1, 1)
        mean, std = self.latents_mean.view(view).to(latents), self.latents_std.view(view).to(latents)
        return latents * std / self.config.scaling_factor + mean

    def decode(self, latents: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised latents -> video ``[B, 3, F, H, W]`` in [-1, 1] (not clamped)."""
        return self.decoder(self.denormalize(latents), t)
