"""Rotary position embedding (rotate-half / NeoX layout, as Hugging Face Llama uses).

The last dimension of a head is split in two halves ``(x1, x2)``; channel ``i`` of each half
rotates by angle ``position * inv_freq[i]``. Optional ``rope_scaling`` rescales the inverse
frequencies: ``"linear"`` (position interpolation) and ``"llama3"`` (Llama 3.1 smooth
frequency-dependent scaling).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Float32 inverse frequencies ``[head_dim // 2]`` for the given RoPE parameters."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise NotImplementedError(f"unsupported rope_scaling type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])

    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > old_len / low  # low frequencies: fully interpolated
    short_wave = wavelen < old_len / high  # high frequencies: untouched
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary positions on the fly and rotates q and k.

    Holds no parameters or buffers (so it never appears in a state dict and is never cast
    to a low-precision dtype); the float32 inverse frequencies are cached per device.
    """

    def __init__(
        self, head_dim: int, rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self._inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)
        self._per_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        inv_freq = self._per_device.get(device)
        if inv_freq is None:
            inv_freq = self._per_device[device] = self._inv_freq.to(device)
        return inv_freq

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, head_dim]`` (computed in float32, cast to ``dtype``)."""
        freqs = positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by their token ``positions [T]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` with per-token ``cos``/``sin`` of shape ``[T, D]``."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (``apply_rotary`` on each). The
    fused in-place kernel of the GPU path is ``mstar.layers.triton_fused.rotary_``."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
