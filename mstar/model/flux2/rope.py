"""FLUX.2's rotary tables over four position axes.

Every token carries an integer position per axis ``(t, h, w, l)``: text tokens are
``(0, 0, 0, i)``, latent-image tokens ``(0, row, col, 0)`` (reference images get a non-zero
``t``). A head of width ``sum(axes_dims)`` is split into one slice per axis, its channel pairs
interleaved (``mstar.layers.rotary.axis_angles`` and ``apply_rotary_pairs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mstar.layers.rotary import axis_angles

# Devices without float64 arithmetic; the angles are computed in float32 there.
_NO_FP64_DEVICES = frozenset({"mps", "npu", "neuron"})


def rope_cos_sin(
    ids: torch.Tensor, axes_dims: Sequence[int], theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos / sin tables for position ids ``[..., S, n_axes]`` -> two float32 ``[..., S, D]``.

    ``D = sum(axes_dims)``; each entry is repeated for both channels of its rotated pair (the
    layout the fused QK-norm + RoPE kernel reads). Angles and their cos / sin are formed in
    float64 and rounded once at the end, as the reference does.
    """
    dtype = torch.float32 if ids.device.type in _NO_FP64_DEVICES else torch.float64
    angle = axis_angles(ids, axes_dims, theta, dtype)
    cos = angle.cos().float().repeat_interleave(2, dim=-1)
    sin = angle.sin().float().repeat_interleave(2, dim=-1)
    return cos, sin


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
