"""Rotary positions of the LTX-2.x DiT, in seconds and pixels rather than token indices.

Each token covers a box of the output: video tokens a span of time (seconds), rows and columns
(pixels); audio tokens a span of time. A token's position on an axis is the centre of its box
as a fraction of a base extent (``pos_embed_max_pos`` seconds, ``base_height`` pixels, ...),
mapped to [-1, 1]; each rotary frequency ``theta ** u * pi / 2`` (``u`` evenly spaced in [0, 1])
turns it. The channels that do not divide evenly among the axes sit first and are not turned.

Two channel layouts (diffusers' ``rope_type``): ``interleaved`` turns the pairs
``(x[2i], x[2i+1])`` across the whole width; ``split`` cuts the width into ``groups`` equal
slices (the heads the table was built for) and turns each slice's first half against its
second. The audio-video cross-attentions use 1-D (time only) tables so both streams share one
clock.
"""

from __future__ import annotations

import math

import torch

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin); interleaved [B, N, W], split [B, N, G, W / 2G]


def video_coords(grid: tuple[int, int, int], scale_factors: tuple[int, int, int], patch: tuple[int, int, int],
                 causal_offset: int, fps: float, device: torch.device | None = None) -> torch.Tensor:
    """``[1, 3, N, 2]`` box bounds [start, end) of the ``grid = (frames, rows, columns)`` latent
    tokens: time in seconds (the first latent frame holds one pixel frame, the causal VAE's
    shortened first step), rows and columns in pixels."""
    axes = [torch.arange(0, n, p, dtype=torch.float32, device=device) for n, p in zip(grid, patch)]
    start = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0).flatten(1)  # [3, N]
    size = torch.tensor(patch, dtype=torch.float32, device=device)[:, None]
    scale = torch.tensor(scale_factors, dtype=torch.float32, device=device)[:, None, None]
    bounds = torch.stack([start, start + size], dim=-1) * scale  # [3, N, 2] in pixels
    time = (bounds[0] + causal_offset - scale_factors[0]).clamp(min=0) / fps
    return torch.cat([time[None], bounds[1:]], dim=0)[None]


def audio_coords(frames: int, scale_factor: int, patch_t: int, causal_offset: int, hop_length: int,
                 sampling_rate: int, device: torch.device | None = None) -> torch.Tensor:
    """``[1, 1, N, 2]`` time bounds in seconds of ``frames`` audio latent frames (each
    ``scale_factor`` mel frames of ``hop_length`` samples; the first shortened like video's)."""
    start = torch.arange(0, frames, patch_t, dtype=torch.float32, device=device)

    def seconds(latent: torch.Tensor) -> torch.Tensor:
        mel = (latent * scale_factor + causal_offset - scale_factor).clamp(min=0)
        return mel * hop_length / sampling_rate

    return torch.stack([seconds(start), seconds(start + patch_t)], dim=-1)[None, None]


class LtxRope:
    """Builds (cos, sin) tables of ``width`` channels for box coordinates ``[B, axes, N, 2]``
    (or centres ``[B, axes, N]``), each axis normalised by its ``extents`` entry."""

    def __init__(self, width: int, extents: tuple[float, ...], theta: float, layout: str, groups: int,
                 double_precision: bool = True) -> None:
        self.width, self.extents, self.theta = width, extents, theta
        self.layout, self.groups, self.double_precision = layout, groups, double_precision

    def __call__(self, coords: torch.Tensor) -> Rope:
        if coords.ndim == 4:
            coords = coords.mean(dim=-1)  # box centre
        axes = coords.shape[1]
        frac = torch.stack([coords[:, i] / self.extents[i] for i in range(axes)], dim=-1)  # [B, N, axes]
        count = self.width // (2 * axes)
        dtype = torch.float64 if self.double_precision else torch.float32
        u = torch.linspace(0.0, 1.0, count, dtype=dtype, device=coords.device)
        freqs = (self.theta**u * (math.pi / 2)).float()
        angles = ((frac[..., None] * 2 - 1) * freqs).transpose(-1, -2).flatten(2)  # [B, N, count * axes]
        cos, sin = angles.cos(), angles.sin()
        if self.layout == "interleaved":
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
            pad = self.width % (2 * axes)
        else:
            pad = self.width // 2 - cos.shape[-1]
        if pad:
            cos = torch.cat([cos.new_ones(*cos.shape[:-1], pad), cos], dim=-1)
            sin = torch.cat([sin.new_zeros(*sin.shape[:-1], pad), sin], dim=-1)
        if self.layout == "split":
            cos, sin = cos.unflatten(-1, (self.groups, -1)), sin.unflatten(-1, (self.groups, -1))
        return cos, sin


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Turn ``x [B, N, W]`` (the projected queries or keys, heads not yet split) by ``rope``, in
    float32; the layout follows the table's shape."""
    cos, sin = rope
    xf = x.float()
    if cos.ndim == 3:  # interleaved pairs
        real, imag = xf.unflatten(-1, (-1, 2)).unbind(-1)
        turned = torch.stack([-imag, real], dim=-1).flatten(-2)
        return (xf * cos + turned * sin).to(x.dtype)
    halves = xf.unflatten(-1, (cos.shape[2], 2, -1))  # [B, N, G, 2, W / 2G]
    first, second = halves.unbind(3)
    out = torch.stack([first * cos - second * sin, second * cos + first * sin], dim=3)
    return out.flatten(2).to(x.dtype)
