"""The Wan VAEs: videos <-> latents, 4x shorter in time. Wan2.2's (``residual``): 48 channels,
16x smaller in each side (pixels patchified by 2, residual down and up blocks with shortcut
averaging and duplication). Wan2.1's (LingBot-World's): 16 channels, 8x smaller, a flat list of
residual blocks and resamplers in the encoder, plain up blocks whose upsamplers halve the width.

Parameter names equal the state dict keys of diffusers' ``AutoencoderKLWan`` (0.42.1) built with
either config, so a checkpoint's ``vae/`` folder loads by name.

Time is causal. Every 3D convolution sees only the present and past frames (zero-padded in
front), and the video is coded chunk by chunk, as the reference does: the encoder takes the
first frame alone, then four frames at a time; the decoder the first latent frame alone, then
one (or ``chunk``) at a time. A ``FrameCache`` carries each convolution's last two input
frames from one chunk to the next, so chunked coding equals coding the whole clip causally
without holding all of its activations.
The first chunk is special where the time resolution changes: the encoder's temporal
downsampler keeps its single frame, the decoder's temporal upsampler does not double it, so
``1 + 4k`` frames map to ``1 + k`` latent frames and back.

A decode may also go on across calls (``DecodeState``): a latent video decoded in pieces, each
piece continuing the state the last one left, equals the decode of the whole; the first piece
of ``T`` latent frames gives ``1 + 4 (T - 1)`` frames, every later one ``4 T``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.triton_channel_norm import channels_last

CACHE_FRAMES = 2  # past input frames a kernel-3 causal convolution needs
DECODE_CHUNK = 1  # latent frames decoded together after the first (as the reference)


class FrameCache(dict):
    """Per-module state between the chunks of one encode or decode: a causal convolution's last
    input frames, a temporal resampler's "seen the first chunk" mark or last frame. Coding
    replaces an entry, never writes into its tensor, so a shallow copy is a snapshot."""


@dataclass
class DecodeState:
    """A decode that goes on across ``WanVAE.decode`` calls: the decoder's ``FrameCache`` and the
    latent frames decoded so far (the first of them decoded alone, as a clip's first)."""

    cache: FrameCache = field(default_factory=FrameCache)
    latent_frames: int = 0

    def copy(self) -> DecodeState:
        """A snapshot: decoding on from the copy leaves this state as it is (it shares the
        cached tensors, which decoding replaces rather than writes)."""
        return DecodeState(FrameCache(self.cache), self.latent_frames)

    @property
    def nbytes(self) -> int:
        """Bytes of the cached frames."""
        return sum(v.nbytes for v in self.cache.values() if isinstance(v, torch.Tensor))


@dataclass(frozen=True)
class WanVAEConfig:
    """The keys of diffusers' ``AutoencoderKLWan`` ``config.json`` that shape the network."""

    base_dim: int = 160
    decoder_base_dim: int = 256
    z_dim: int = 48
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    in_channels: int = 12
    out_channels: int = 12
    patch_size: int = 2
    scale_factor_temporal: int = 4
    scale_factor_spatial: int = 16
    latents_mean: tuple[float, ...] = ()
    latents_std: tuple[float, ...] = ()
    residual: bool = True  # Wan2.2's blocks; False: Wan2.1's

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WanVAEConfig:
        """Build from a diffusers ``config.json`` dict; options we do not implement raise, naming
        the key."""
        residual = bool(data.get("is_residual", False))
        if data.get("attn_scales"):
            raise ValueError(f"vae config: attn_scales {data['attn_scales']} is not supported (only [])")
        if residual and data.get("patch_size") is None:
            raise ValueError("vae config: patch_size is missing (the Wan2.2 VAE patchifies by 2)")
        if not residual and data.get("patch_size") not in (None, 1):
            raise ValueError(f"vae config: patch_size {data['patch_size']} with is_residual false is not supported")
        base = int(data.get("base_dim", 96))
        return cls(
            base_dim=base, decoder_base_dim=int(data.get("decoder_base_dim") or base), z_dim=int(data["z_dim"]),
            dim_mult=tuple(int(m) for m in data.get("dim_mult", (1, 2, 4, 4))),
            num_res_blocks=int(data.get("num_res_blocks", 2)),
            temperal_downsample=tuple(bool(t) for t in data.get("temperal_downsample", (False, True, True))),
            in_channels=int(data.get("in_channels", 3)), out_channels=int(data.get("out_channels", 3)),
            patch_size=int(data.get("patch_size") or 1),
            scale_factor_temporal=int(data.get("scale_factor_temporal") or 4),
            scale_factor_spatial=int(data.get("scale_factor_spatial") or 8),
            latents_mean=tuple(float(v) for v in data["latents_mean"]),
            latents_std=tuple(float(v) for v in data["latents_std"]), residual=residual)


class CausalConv3d(nn.Conv3d):
    """A 3D convolution padded only in front in time (``2 * padding`` frames); with a
    ``FrameCache`` the front padding is the previous chunk's last input frames instead. Space is
    zero-padded by the convolution itself (no padded copy of the input)."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int | tuple[int, int, int], stride: int | tuple = 1,
                 padding: int | tuple[int, int, int] = 0) -> None:
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else padding
        super().__init__(in_dim, out_dim, kernel, stride=stride, padding=(0, ph, pw))
        self.time_pad = 2 * pt

    def forward(self, x: torch.Tensor, cache: FrameCache | None = None) -> torch.Tensor:
        if self.time_pad:
            past = cache.get(self) if cache is not None else None
            if past is None:
                x = F.pad(x, (0, 0, 0, 0, self.time_pad, 0))
            else:
                x = torch.cat([past, x], dim=2)
            if cache is not None:
                cache[self] = x[:, :, -CACHE_FRAMES:].clone()  # not a view: it would hold the whole chunk
        return super().forward(x)

    def padded_input(self, like: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
        """An uninitialised input of ``like``'s shape and layout with this convolution's past
        frames (the cached ones, or zeros) already in front: write the input into
        ``[:, :, time_pad:]``, then call ``forward_padded``. No concatenation copies the input."""
        b, c, t, h, w = like.shape
        layout = torch.channels_last_3d if channels_last(like) else torch.contiguous_format
        padded = torch.empty((b, c, self.time_pad + t, h, w), device=like.device, dtype=like.dtype,
                             memory_format=layout)
        past = cache.get(self) if cache is not None else None
        front = padded[:, :, : self.time_pad]
        front.zero_() if past is None else front.copy_(past)
        return padded

    def forward_padded(self, padded: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
        """``forward`` of an input from ``padded_input``, its front frames filled there."""
        if cache is not None:
            cache[self] = padded[:, :, -CACHE_FRAMES:].clone()
        return super().forward(padded)


def norm_conv(norm: RMSNorm, conv: CausalConv3d, x: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
    """``conv(norm(x, silu=True), cache)``; under the fused kernels the norm writes straight into
    the convolution's input behind its past frames (one pass over the activation fewer)."""
    if not norm.fused or not conv.time_pad:
        return conv(norm(x, silu=True), cache)
    padded = conv.padded_input(x, cache)
    norm(x, silu=True, out=padded[:, :, conv.time_pad:])
    return conv.forward_padded(padded, cache)


def conv_frames(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A 2D convolution applied to every frame of ``[B, C, T, H, W]``, as a 3D convolution whose
    kernel spans one frame (no transposed copies of the video)."""
    return F.conv3d(x, conv.weight.unsqueeze(2), conv.bias, (1, *conv.stride), (0, *conv.padding))


class RMSNorm(nn.Module):
    """``x / ||x||`` over channels, times ``sqrt(dim) * gamma`` (diffusers' ``WanRMS_norm``);
    ``silu`` applies SiLU to the result (the residual blocks' norm-then-activation). ``fused``:
    one Triton kernel (``mstar.layers.triton_channel_norm``) in place of the eager ops."""

    def __init__(self, dim: int, images: bool = False) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1) if images else torch.ones(dim, 1, 1, 1))
        self.fused = False

    def forward(self, x: torch.Tensor, silu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` (fused only): where the kernel writes, e.g. a convolution's padded input."""
        if self.fused:
            from mstar.layers.triton_channel_norm import channel_norm

            return channel_norm(x, self.gamma * self.scale, silu, out=out)
        if out is not None:
            raise ValueError("RMSNorm writes into out= only with the fused kernel")
        low = x.dtype in (torch.float16, torch.bfloat16)
        y = F.normalize(x.float() if low else x, dim=1)
        y = y.to(x.dtype) if low else y
        y = y.mul_(self.scale).mul_(self.gamma)
        return F.silu(y, inplace=True) if silu else y


def use_fused_kernels(vae: nn.Module, enabled: bool = True) -> None:
    """Run every VAE ``RMSNorm`` under ``vae`` (with its SiLU) as one Triton kernel, and every
    upsampler's convolution on the frames before they are doubled (``upsample_conv``)."""
    for module in vae.modules():
        if isinstance(module, (RMSNorm, Upsample)):
            module.fused = enabled


def use_channels_last(vae: nn.Module, enabled: bool = True) -> None:
    """Hold every convolution's weights channels-last (``enabled``) or contiguous. On CUDA, cuDNN
    then returns channels-last activations, which the norms, SiLU and caches keep, so its
    convolutions skip the NCHW <-> NHWC conversions around each call. The same numbers either way."""
    for module in vae.modules():
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            layout = (torch.channels_last_3d if module.weight.ndim == 5 else torch.channels_last) if enabled \
                else torch.contiguous_format
            module.weight.data = module.weight.data.contiguous(memory_format=layout)


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = norm_conv(self.norm1, self.conv1, x, cache)
        return norm_conv(self.norm2, self.conv2, x, cache).add_(skip)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        q, k, v = self.to_qkv(self.norm(frames)).flatten(2).transpose(1, 2)[:, None].chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)[:, 0].transpose(1, 2).reshape(b * t, c, h, w)
        return self.proj(out).view(b, t, c, h, w).transpose(1, 2) + x


class MidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        return self.resnets[1](self.attentions[0](x), cache)


class Downsample(nn.Module):
    """Halve height and width (a stride-2 conv, padded right and bottom); with ``temporal``, also
    halve time (a stride-2 causal conv over the previous chunk's last frame and this chunk)."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = conv_frames(self.resample[1], F.pad(x, (0, 1, 0, 1)))
        if self.time_conv is None:
            return x
        past = cache.get(self)
        cache[self] = x[:, :, -1:]
        return x if past is None else self.time_conv(torch.cat([past, x], dim=2))


class Upsample(nn.Module):
    """Double height and width (nearest, then a conv to ``out_dim``, ``dim`` by default); with
    ``temporal``, also double time from the second chunk on (a causal conv emits two frames per
    frame)."""

    def __init__(self, dim: int, temporal: bool, out_dim: int | None = None) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                      nn.Conv2d(dim, out_dim or dim, 3, padding=1))
        self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0)) if temporal else None
        self.fused = False
        self._phases: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        if self.time_conv is not None:
            if self in cache:
                x = interleave_frames(self.time_conv(x, cache))
            else:
                cache[self] = True  # the first chunk: its frame is not doubled
        if self.fused:
            return upsample_conv(x, *self.phase_weights())
        return conv_frames(self.resample[1], double_space(x))

    def phase_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``phase_kernels`` of the convolution, made again only when its weights change."""
        conv = self.resample[1]
        key = (conv.weight.data_ptr(), tensor_version(conv.weight), conv.weight.dtype, conv.weight.device)
        if self._phases is None or self._phases[0] != key:
            bias = None if conv.bias is None else conv.bias.repeat(4)
            self._phases = (key, phase_kernels(conv.weight), bias)
        return self._phases[1], self._phases[2]


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place write counter; -1 for a tensor made under inference mode, which has none."""
    try:
        return t._version
    except RuntimeError:
        return -1


def phase_kernels(weight: torch.Tensor) -> torch.Tensor:
    """A 3x3 kernel ``[O, I, 3, 3]`` applied after nearest 2x upsampling, as four 2x2 kernels on
    the frames before it, stacked ``[4 O, I, 1, 2, 2]`` (phase ``2r + s`` makes the output pixels
    ``(2i + r, 2j + s)``). An upsampled row ``2i + r`` repeats row ``i``, so the kernel's three
    rows fall on two input rows: ``i - 1`` and ``i`` for ``r = 0`` (taps 0 and 1 + 2), ``i`` and
    ``i + 1`` for ``r = 1`` (taps 0 + 1 and 2); columns likewise. Zero padding maps to zero padding."""
    def halves(k: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Three taps along ``dim`` -> the two-tap kernels of phase 0 and phase 1."""
        a, b, c = k.unbind(dim)
        return torch.stack([a, b + c], dim), torch.stack([a + b, c], dim)

    summed = weight.to(torch.promote_types(weight.dtype, torch.float32))  # sums of bf16 taps in float32
    phases = [p for rows in halves(summed, 2) for p in halves(rows, 3)]
    layout = torch.channels_last_3d if channels_last(weight.unsqueeze(2)) else torch.contiguous_format
    return torch.cat(phases).unsqueeze(2).to(weight.dtype).contiguous(memory_format=layout)


def upsample_conv(x: torch.Tensor, kernels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv_frames`` of ``double_space(x)`` (a 3x3 convolution, padding 1) without making the
    upsampled frames: one convolution of ``x`` with the four ``phase_kernels`` (4/9 of the
    products), each phase's pixels then put in place. The same numbers up to rounding."""
    b, c, t, h, w = x.shape
    out = F.conv3d(x, kernels, bias, padding=(0, 1, 1))  # [B, 4 O, T, H + 1, W + 1]
    o = kernels.shape[0] // 4
    if channels_last(out):
        video = torch.empty((b, t, h, 2, w, 2, o), device=x.device, dtype=out.dtype)
        pixels = out.permute(0, 2, 3, 4, 1)
        for r in (0, 1):
            for s in (0, 1):
                video[:, :, :, r, :, s] = pixels[:, :, r:r + h, s:s + w, (2 * r + s) * o:(2 * r + s + 1) * o]
        return video.view(b, t, 2 * h, 2 * w, o).permute(0, 4, 1, 2, 3)
    video = torch.empty((b, o, t, h, 2, w, 2), device=x.device, dtype=out.dtype)
    for r in (0, 1):
        for s in (0, 1):
            video[:, :, :, :, r, :, s] = out[:, (2 * r + s) * o:(2 * r + s + 1) * o, :, r:r + h, s:s + w]
    return video.view(b, o, t, 2 * h, 2 * w)


def interleave_frames(x: torch.Tensor) -> torch.Tensor:
    """``[B, 2C, T, H, W]`` (two halves of channels: each frame's two successors) -> ``[B, C, 2T, H,
    W]`` with frame ``2i`` from the first half and ``2i + 1`` from the second; in ``x``'s layout."""
    b, c2, t, h, w = x.shape
    c = c2 // 2
    if channels_last(x):  # [B, T, H, W, 2, C] in memory -> [B, T, 2, H, W, C]
        pixels = x.permute(0, 2, 3, 4, 1).view(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5)
        return pixels.reshape(b, 2 * t, h, w, c).permute(0, 4, 1, 2, 3)
    x = x.view(b, 2, c, t, h, w)
    return torch.stack([x[:, 0], x[:, 1]], dim=3).reshape(b, c, 2 * t, h, w)


def double_space(x: torch.Tensor) -> torch.Tensor:
    """Nearest upsampling of ``[B, C, T, H, W]`` to ``2H x 2W`` (each pixel repeated; what
    ``nearest-exact`` gives at a scale of 2), in ``x``'s layout."""
    b, c, t, h, w = x.shape
    if channels_last(x):  # one copy of [B, T, H, W, C] with every pixel written four times
        pixels = x.permute(0, 2, 3, 4, 1)[:, :, :, None, :, None].expand(b, t, h, 2, w, 2, c)
        return pixels.reshape(b, t, 2 * h, 2 * w, c).permute(0, 4, 1, 2, 3)
    # frames as channels: the 2D kernel (the 3D one is ~3x slower on a GPU)
    x = F.interpolate(x.reshape(b, c * t, h, w), scale_factor=2.0, mode="nearest-exact")  # copies values
    return x.view(b, c, t, 2 * h, 2 * w)


def avg_down(x: torch.Tensor, out_dim: int, factor_t: int, factor_s: int) -> torch.Tensor:
    """The down blocks' shortcut: space (and time) folded into channels, then channel groups
    averaged to ``out_dim``; time is zero-padded in front to a multiple of ``factor_t``."""
    x = F.pad(x, (0, 0, 0, 0, (-x.shape[2]) % factor_t, 0))
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(b, out_dim, -1, t // factor_t, h // factor_s, w // factor_s)
    return x.mean(dim=2)


def dup_up(x: torch.Tensor, out_dim: int, factor_t: int, factor_s: int, first_chunk: bool) -> torch.Tensor:
    """The up blocks' shortcut: channels repeated and unfolded into space (and time); the first
    chunk keeps only its last ``1`` of ``factor_t`` frames."""
    b, c, t, h, w = x.shape
    repeat = out_dim * factor_t * factor_s * factor_s // c  # each channel repeated in place, as a view
    if channels_last(x):  # [B, T, ft, H, fs, W, fs, out] in memory: the activation's layout
        x = x.permute(0, 2, 3, 4, 1)[..., None].expand(b, t, h, w, c, repeat)
        x = x.reshape(b, t, h, w, out_dim, factor_t, factor_s, factor_s).permute(0, 1, 5, 2, 6, 3, 7, 4)
        x = x.reshape(b, t * factor_t, h * factor_s, w * factor_s, out_dim).permute(0, 4, 1, 2, 3)
    else:
        x = x[:, :, None].expand(b, c, repeat, t, h, w).reshape(b, out_dim, factor_t, factor_s, factor_s, t, h, w)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, out_dim, t * factor_t, h * factor_s, w * factor_s)
    return x[:, :, factor_t - 1:] if first_chunk else x


class DownBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, blocks: int, temporal: bool, down: bool) -> None:
        super().__init__()
        self.out_dim, self.factor_t, self.factor_s = out_dim, 2 if temporal else 1, 2 if down else 1
        self.resnets = nn.ModuleList(ResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(blocks))
        self.downsampler = Downsample(out_dim, temporal) if down else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        skip = avg_down(x, self.out_dim, self.factor_t, self.factor_s)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return x + skip


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, blocks: int, temporal: bool, up: bool) -> None:
        super().__init__()
        self.out_dim, self.factor_t, self.up = out_dim, 2 if temporal else 1, up
        self.resnets = nn.ModuleList(ResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(blocks + 1))
        self.upsampler = Upsample(out_dim, temporal) if up else None

    def forward(self, x: torch.Tensor, cache: FrameCache, first_chunk: bool) -> torch.Tensor:
        skip = dup_up(x, self.out_dim, self.factor_t, 2, first_chunk) if self.up else None
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsampler is not None:
            x = self.upsampler(x, cache)
        return x if skip is None else x.add_(skip)


class PlainUpBlock(nn.Module):
    """Wan2.1's up block: residual blocks, then an upsampler that halves the width."""

    def __init__(self, in_dim: int, out_dim: int, blocks: int, temporal: bool, up: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(blocks + 1))
        self.upsamplers = nn.ModuleList([Upsample(out_dim, temporal, out_dim // 2)]) if up else None

    def forward(self, x: torch.Tensor, cache: FrameCache, first_chunk: bool) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        return x if self.upsamplers is None else self.upsamplers[0](x, cache)


def plain_down_blocks(config: WanVAEConfig, dims: list[int]) -> list[nn.Module]:
    """Wan2.1's encoder body as one flat list: each level's residual blocks, then its downsampler."""
    blocks: list[nn.Module] = []
    last = len(config.dim_mult) - 1
    for i in range(len(config.dim_mult)):
        blocks += [ResidualBlock(dims[i] if j == 0 else dims[i + 1], dims[i + 1]) for j in range(config.num_res_blocks)]
        if i != last:
            blocks.append(Downsample(dims[i + 1], config.temperal_downsample[i]))
    return blocks


class Encoder(nn.Module):
    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        dims = [config.base_dim * m for m in (1, *config.dim_mult)]
        last = len(config.dim_mult) - 1
        self.conv_in = CausalConv3d(config.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            DownBlock(dims[i], dims[i + 1], config.num_res_blocks, i != last and config.temperal_downsample[i],
                      i != last) for i in range(len(config.dim_mult))) if config.residual else \
            nn.ModuleList(plain_down_blocks(config, dims))
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], 2 * config.z_dim, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return norm_conv(self.norm_out, self.conv_out, x, cache)


class Decoder(nn.Module):
    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        mult = config.dim_mult
        dims = [config.decoder_base_dim * m for m in (mult[-1], *mult[::-1])]
        upsample_t = config.temperal_downsample[::-1]
        last = len(mult) - 1
        self.conv_in = CausalConv3d(config.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        block = UpBlock if config.residual else PlainUpBlock
        # Wan2.1's upsamplers halve the width, so its blocks after the first take half
        ins = [d if config.residual or i == 0 else d // 2 for i, d in enumerate(dims[:-1])]
        self.up_blocks = nn.ModuleList(
            block(ins[i], dims[i + 1], config.num_res_blocks, i != last and upsample_t[i], i != last)
            for i in range(len(mult)))
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], config.out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache, first_chunk: bool) -> torch.Tensor:
        x = self.mid_block(self.conv_in(x, cache), cache)
        for block in self.up_blocks:
            x = block(x, cache, first_chunk)
        return norm_conv(self.norm_out, self.conv_out, x, cache)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``[B, C, T, H, W]`` -> ``[B, C * p * p, T, H / p, W / p]`` (channel order: c, column, row)."""
    if p == 1:
        return x
    b, c, t, h, w = x.shape
    x = x.view(b, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, t, h // p, w // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    if p == 1:
        return x
    b, cp, t, h, w = x.shape
    x = x.view(b, cp // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cp // (p * p), t, h * p, w * p)


class WanVAE(nn.Module):
    """The Wan2.2 (or Wan2.1) autoencoder with diffusers ``AutoencoderKLWan`` parameter names."""

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1)
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """``[B, 3, 1 + 4k, H, W]`` in ``[-1, 1]`` -> the posterior mean ``[B, z_dim, 1 + k, H / s,
        W / s]`` (VAE latents, not normalised; ``s`` 16 for Wan2.2, 8 for Wan2.1)."""
        x = patchify(video, self.config.patch_size)
        cache = FrameCache()
        step = self.config.scale_factor_temporal
        if (x.shape[2] - 1) % step:
            raise ValueError(f"the VAE encodes 1 + {step}k frames, got {x.shape[2]}")
        chunks = [x[:, :, :1], *(x[:, :, 1:].split(step, dim=2) if x.shape[2] > 1 else ())]
        out = torch.cat([self.encoder(chunk, cache) for chunk in chunks], dim=2)
        return self.quant_conv(out)[:, : self.config.z_dim]

    def decode(self, latents: torch.Tensor, chunk: int = DECODE_CHUNK,
               state: DecodeState | None = None) -> torch.Tensor:
        """VAE latents ``[B, z_dim, T, h, w]`` -> video ``[B, 3, 1 + 4 (T - 1), 16h, 16w]`` in ``[-1, 1]``.

        The first latent frame is decoded alone, the rest ``chunk`` latent frames at a time: the
        reference decodes one at a time, and as every layer is causal in time and carries its
        past in the cache, larger chunks give the same video with fewer, larger convolutions
        (~2% faster at 4 for S8's clip on an H100) and several times the activations.

        ``state``: go on from an earlier decode (a fresh ``DecodeState`` starts one), and leave
        ``state`` at the end of ``latents``. Once its first latent frame is decoded, the next
        ``T`` latent frames give ``4 T`` frames, so the pieces' videos, joined, are the decode
        of the joined latents (exactly, at ``chunk`` 1: the same convolutions on the same
        frames)."""
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        state = DecodeState() if state is None else state
        first = latents[:, :, :1] if state.latent_frames == 0 else latents[:, :, :0]
        rest = latents[:, :, first.shape[2]:]
        chunks = [(first, True)] if first.shape[2] else []
        chunks += [(part, False) for part in rest.split(chunk, dim=2)] if rest.shape[2] else []
        # post_quant_conv (1x1x1) chunk by chunk too: a whole decode and a carried one then run
        # the same ops on the same shapes (one GEMM over all frames rounds differently, ~1e-7)
        out = torch.cat([self.decoder(self.post_quant_conv(part), state.cache, first_chunk)
                         for part, first_chunk in chunks], dim=2)
        state.latent_frames += latents.shape[2]
        return unpatchify(out, self.config.patch_size).clamp_(-1.0, 1.0)

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, 1 / std)``, per channel, computed in float32 then cast to ``latents``' dtype."""
        shape = (-1,) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(self.config.latents_mean, device=latents.device).view(shape)
        inv_std = 1.0 / torch.tensor(self.config.latents_std, device=latents.device).view(shape)
        return mean.to(latents.dtype), inv_std.to(latents.dtype)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents ``[B, C, ...]`` -> the DiT's ``(z - mean) * (1 / std)`` (the pipeline's order of ops)."""
        mean, inv_std = self._stats(latents)
        return (latents - mean) * inv_std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT's latents ``[B, C, ...]`` -> VAE latents ``z / (1 / std) + mean`` (the pipeline's order)."""
        mean, inv_std = self._stats(latents)
        return latents / inv_std + mean


def frames_uint8(video: torch.Tensor) -> torch.Tensor:
    """Decoded ``[3, F, H, W]`` in ``[-1, 1]`` -> uint8 frames ``[F, H, W, 3]``."""
    return ((video.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0)


__all__: Sequence[str] = ["DecodeState", "FrameCache", "WanVAE", "WanVAEConfig", "frames_uint8", "use_channels_last",
                          "use_fused_kernels"]
