"""Multimodal RoPE (MRoPE) of Qwen3.5: partial rotary, frequencies interleaved over axes.

Every token has three positions (temporal, height, width); text tokens have all three
equal, so for text MRoPE is ordinary RoPE. Only the first ``rotary_dim`` channels of a head
rotate (rotate-half layout within them). Of the ``rotary_dim / 2`` frequencies, index ``i``
follows the height axis when ``i % 3 == 1`` and ``i < 3 * section[1]``, the width axis when
``i % 3 == 2`` and ``i < 3 * section[2]``, and the temporal axis otherwise (the released
checkpoints' sections, ``[11, 11, 10]``, split the 32 frequencies of their 64 rotary channels).
"""

from __future__ import annotations

import torch

from mstar.layers.rotary import rotate_half


class MRotaryEmbedding:
    """cos/sin for ``[3, T]`` (or text-only ``[T]``) positions, and their application."""

    def __init__(self, rotary_dim: int, rope_theta: float, section: list[int]) -> None:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        self.inv_freq = 1.0 / (rope_theta**exponents)
        axis = torch.zeros(rotary_dim // 2, dtype=torch.int64)
        index = torch.arange(rotary_dim // 2)
        for dim in (1, 2):
            axis[(index % 3 == dim) & (index < 3 * section[dim])] = dim
        self.axis = axis  # which position axis drives each frequency
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, rotary_dim]`` (float32 maths, cast to ``dtype``)."""
        if positions.dim() == 1:
            positions = positions[None].expand(3, -1)
        inv_freq, axis = self.inv_freq.to(positions.device), self.axis.to(positions.device)
        per_freq = positions.float().gather(0, axis[:, None].expand(-1, positions.shape[1]))  # [F, T]
        freqs = per_freq.T * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [T, H, D]``; the rest pass through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
