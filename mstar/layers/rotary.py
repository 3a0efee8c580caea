"""Rotary position embedding: the tables and the rotations every model here uses.

Two channel layouts:

* **rotate-half** (NeoX, as Hugging Face Llama uses): the last dimension of a head is split in
  two halves ``(x1, x2)``; channel ``i`` of each half rotates by angle ``position * inv_freq[i]``
  (``apply_rotary``, ``rotate``). Llama, Qwen3, Qwen3.5 (text: partial and multimodal, vision:
  2D) and SNAC.
* **interleaved** (complex pairs): channels ``(2j, 2j + 1)`` rotate together
  (``apply_rotary_pairs``). FLUX.2 and Z-Image, whose tables span several position axes
  (``axis_angles``).

Optional ``rope_scaling`` rescales the inverse frequencies: ``"linear"`` (position
interpolation) and ``"llama3"`` (Llama 3.1 smooth frequency-dependent scaling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def cos_sin_tables(freqs: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half ``cos, sin [..., 2F]`` of angles ``freqs [..., F]`` (each angle serves both
    halves), computed in ``freqs``' dtype and cast to ``dtype`` (None: kept)."""
    angles = torch.cat((freqs, freqs), dim=-1)
    if dtype is None:
        return angles.cos(), angles.sin()
    return angles.cos().to(dtype), angles.sin().to(dtype)


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
        return cos_sin_tables(freqs, dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by their token ``positions [T]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"




class MRotaryEmbedding:
    """Multimodal RoPE (MRoPE) of Qwen3.5: partial rotary, frequencies interleaved over axes.

    Every token has three positions (temporal, height, width); text tokens have all three
    equal, so for text MRoPE is ordinary RoPE. Only the first ``rotary_dim`` channels of a head
    rotate (``apply_rotary`` passes the rest through). Of the ``rotary_dim / 2`` frequencies,
    index ``i`` follows the height axis when ``i % 3 == 1`` and ``i < 3 * section[1]``, the width
    axis when ``i % 3 == 2`` and ``i < 3 * section[2]``, and the temporal axis otherwise (the
    released checkpoints' sections, ``[11, 11, 10]``, split the 32 frequencies of their 64
    rotary channels).
    """

    def __init__(self, rotary_dim: int, rope_theta: float, section: list[int]) -> None:
        self.inv_freq = rope_inv_freq(rotary_dim, rope_theta)
        axis = torch.zeros(rotary_dim // 2, dtype=torch.int64)
        index = torch.arange(rotary_dim // 2)
        for dim in (1, 2):
            axis[(index % 3 == dim) & (index < 3 * section[dim])] = dim
        self.axis = axis  # which position axis drives each frequency
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, rotary_dim]`` for ``[3, T]`` (or text-only ``[T]``) positions (float32
        maths, cast to ``dtype``)."""
        if positions.dim() == 1:
            positions = positions[None].expand(3, -1)
        inv_freq, axis = self.inv_freq.to(positions.device), self.axis.to(positions.device)
        per_freq = positions.float().gather(0, axis[:, None].expand(-1, positions.shape[1]))  # [F, T]
        return cos_sin_tables(per_freq.T * inv_freq[None, :], dtype)


def axis_angles(positions: torch.Tensor, axes_dims: Sequence[int], theta: float,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Angles ``[..., S, sum(axes_dims) / 2]`` of integer positions ``[..., S, n_axes]`` over several
    axes: in the slice of axis ``a`` (width ``d``), pair ``j`` turns by ``position_a * theta **
    (-2j / d)``. Formed in ``dtype`` (float64 as FLUX.2's and Z-Image's references do; positions
    pass through float32 first, exact for any position a model uses). Extra position columns
    beyond ``len(axes_dims)`` are ignored."""
    if positions.shape[-1] < len(axes_dims):
        raise ValueError(f"positions have {positions.shape[-1]} axes, rope needs {len(axes_dims)}")
    pos = positions.to(torch.float32).to(dtype)
    angles = []
    for axis, dim in enumerate(axes_dims):
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=dtype, device=positions.device) / dim)
        angles.append(pos[..., axis, None] * inv_freq)
    return torch.cat(angles, dim=-1)


# ------------------------------------------------------------------- rotations
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half rotation ``x cos + rotate_half(x) sin``, tables broadcast against ``x``."""
    return x * cos + rotate_half(x) * sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, float32: bool = False) -> torch.Tensor:
    """Rotate ``x [..., T, H, D]`` with per-token tables ``[T, R]`` (broadcast over heads). ``R < D``:
    only the first ``R`` channels rotate, the rest pass through (partial rotary). ``float32``:
    ``x`` rotated in float32, the result in its own dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    dim = cos.shape[-1]
    rot = x[..., :dim] if dim < x.shape[-1] else x
    out = rotate(rot.float(), cos, sin).to(x.dtype) if float32 else rotate(rot, cos, sin)
    return torch.cat((out, x[..., dim:]), dim=-1) if dim < x.shape[-1] else out


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (``apply_rotary`` on each). The
    fused in-place kernel of the GPU path is ``mstar.layers.triton_fused.rotary_``."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent channel pairs of ``x [..., S, H, D]``: pair ``(x0, x1)`` becomes
    ``(x0 cos - x1 sin, x0 sin + x1 cos)``, maths in float32, the result in ``x``'s dtype.
    Tables ``[..., S, D / 2]`` (one angle per pair, Z-Image's) or ``[..., S, D]`` (each angle
    repeated for both channels of its pair, FLUX.2's, which its fused kernel reads), shared by
    the heads."""
    if cos.shape[-1] == x.shape[-1]:
        cos, sin = cos[..., ::2], sin[..., ::2]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).to(x.dtype)
