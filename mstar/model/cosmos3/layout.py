"""Where a request's tokens sit in the packed sequence: rotary positions of its text and its
video latent patches (diffusers' ``Cosmos3OmniPipeline`` layout).

Text comes first at positions ``0 .. L - 1`` on all three axes. Media starts
``unified_3d_mrope_temporal_modality_margin`` positions after the text. A video's patch at
(frame ``f``, row ``r``, column ``c``) sits at time ``offset + f`` and at row ``r`` and column
``c`` (``reset_spatial_ids``; otherwise shifted by the offset too). With fps modulation (and more
than one latent frame) the time axis is scaled to the training rate: ``offset + f * (base_fps /
fps)`` (both rates per latent frame), positions as float32.

Sound latents start at the same time offset as the video (the two are aligned in time): latent
``f`` at ``offset + f * base_fps / sound_latent_fps`` under fps modulation (``offset + f``
without), row and column 0.
"""

from __future__ import annotations

import torch

from mstar.model.cosmos3.config import Cosmos3Config

TIME_COMPRESSION = 4  # the Wan2.2 VAE codes the first frame alone, then four at a time


def text_positions(config: Cosmos3Config, length: int) -> torch.Tensor:
    """``[3, length]`` positions of a prompt's tokens (float32 under fps modulation)."""
    dtype = torch.float32 if config.enable_fps_modulation else torch.long
    return torch.arange(length, dtype=dtype)[None].expand(3, -1).contiguous()


def media_offset(config: Cosmos3Config, text_length: int) -> int:
    return text_length + config.unified_3d_mrope_temporal_modality_margin


def video_positions(config: Cosmos3Config, grid: tuple[int, int, int], offset: int, fps: float) -> torch.Tensor:
    """``[3, T * h * w]`` positions of a video's patches on the patch ``grid`` (frames, rows,
    columns), starting at time ``offset``."""
    t, h, w = grid
    rows = torch.arange(h).view(1, -1, 1).expand(t, h, w).flatten()
    cols = torch.arange(w).view(1, 1, -1).expand(t, h, w).flatten()
    if not config.unified_3d_mrope_reset_spatial_ids:
        rows, cols = rows + offset, cols + offset
    if config.enable_fps_modulation and t > 1:
        frames = torch.arange(t, dtype=torch.float32) / (fps / TIME_COMPRESSION) * (config.base_fps / TIME_COMPRESSION)
        time = (frames + offset).view(-1, 1).expand(t, h * w).flatten()
        return torch.stack([time, rows.float(), cols.float()])
    time = (torch.arange(t) + offset).view(-1, 1).expand(t, h * w).flatten()
    return torch.stack([time, rows, cols])


def sound_positions(config: Cosmos3Config, length: int, offset: int) -> torch.Tensor:
    """``[3, length]`` positions of a request's sound latents, starting at time ``offset``."""
    zeros = torch.zeros(length, dtype=torch.long) + (0 if config.unified_3d_mrope_reset_spatial_ids else offset)
    if config.enable_fps_modulation and length > 1:
        time = torch.arange(length, dtype=torch.float32) / config.sound_latent_fps * config.base_fps + offset
        return torch.stack([time, zeros.float(), zeros.float()])
    return torch.stack([torch.arange(length) + offset, zeros, zeros])


def patch_grid(config: Cosmos3Config, latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The patch grid of latents ``[C, T, H, W]``."""
    p = config.latent_patch_size
    _, t, h, w = latent_shape
    return t, -(-h // p), -(-w // p)


def action_positions(config: Cosmos3Config, length: int, offset: int, fps: float) -> torch.Tensor:
    """``[3, length]`` positions of an action chunk's tokens, starting after time ``offset``."""
    zeros = torch.zeros(length, dtype=torch.long)
    if not config.unified_3d_mrope_reset_spatial_ids:
        zeros = zeros + offset
    if config.enable_fps_modulation and length > 1:
        time = (torch.arange(length, dtype=torch.float32) + 1) / fps * (config.base_fps / TIME_COMPRESSION) + offset
        return torch.stack([time, zeros.float(), zeros.float()])
    return torch.stack([torch.arange(length) + offset + 1, zeros, zeros])
