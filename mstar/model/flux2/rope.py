"""Multi-axis rotary position embedding of FLUX.2.

Every token carries an integer position per axis; FLUX.2 uses four axes ``(t, h, w, l)``:
text tokens are ``(0, 0, 0, i)``, latent-image tokens ``(0, row, col, 0)`` (reference images
get a non-zero ``t``). A head of width ``sum(axes_dims)`` is split into one slice per axis; in
the slice of an axis of width ``d``, the channel pair ``(2j, 2j + 1)`` is rotated by the angle
``position * theta ** (-2j / d)``. Pairs are adjacent channels (interleaved layout), unlike the
rotate-half layout of ``mstar.layers.rotary``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# Devices without float64 arithmetic; the angles are computed in float32 there.
_NO_FP64_DEVICES = frozenset({"mps", "npu", "neuron"})


def rope_cos_sin(
    ids: torch.Tensor, axes_dims: Sequence[int], theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos / sin tables for position ids ``[..., S, n_axes]`` -> two float32 ``[..., S, D]``.

    ``D = sum(axes_dims)``; each entry is repeated for both channels of its rotated pair. Extra
    id columns beyond ``len(axes_dims)`` are ignored. Angles are formed in float64 (positions
    go through float32 first, as the reference does) and rounded once at the end.
    """
    if ids.shape[-1] < len(axes_dims):
        raise ValueError(f"ids have {ids.shape[-1]} axes, rope needs {len(axes_dims)}")
    dtype = torch.float32 if ids.device.type in _NO_FP64_DEVICES else torch.float64
    pos = ids.to(torch.float32).to(dtype)
    angles = []
    for axis, dim in enumerate(axes_dims):
        exponents = torch.arange(0, dim, 2, dtype=dtype, device=ids.device) / dim
        inv_freq = 1.0 / (theta**exponents)  # [dim / 2]
        angles.append(pos[..., axis, None] * inv_freq)  # [..., S, dim / 2]
    angle = torch.cat(angles, dim=-1)
    cos = angle.cos().float().repeat_interleave(2, dim=-1)
    sin = angle.sin().float().repeat_interleave(2, dim=-1)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, H, D]`` by tables ``[S, D]`` (shared) or ``[B, S, D]`` (per sample).

    Pair ``(x0, x1)`` becomes ``(x0 cos - x1 sin, x1 cos + x0 sin)``; math in float32, the
    result has ``x``'s dtype.
    """
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Flux2RotaryEmbedding(nn.Module):
    """Parameter-free module: position ids ``[..., S, n_axes]`` -> ``(cos, sin)`` tables."""

    def __init__(self, axes_dims: Sequence[int], theta: float) -> None:
        super().__init__()
        self.axes_dims = tuple(int(d) for d in axes_dims)
        self.theta = theta

    @property
    def head_dim(self) -> int:
        return sum(self.axes_dims)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(ids, self.axes_dims, self.theta)
