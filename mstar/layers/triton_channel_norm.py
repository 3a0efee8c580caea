"""RMS norm over channels, a per-channel scale and SiLU in one Triton kernel.

Video VAEs (Wan2.2's) normalise every pixel's channel vector to unit length, scale each
channel, and most often apply SiLU before the next convolution: on ``[B, C, T, H, W]``
activations of hundreds of megabytes, op by op that is a reduction, a division, two products and
the activation, each a pass over the tensor. ``channel_norm`` reads the tensor twice (the sum of
squares per pixel, then the normalised, scaled, activated values) and writes it once.

Each program takes one row ``b`` and a block of ``BLOCK_S`` pixels and walks the channels in
tiles of ``BLOCK_C`` (the channel count is a compile-time constant: a network has a few); sums
are kept in float32 whatever the dtype. The tensor is read in its own layout: contiguous
(pixels of a channel adjacent) or channels-last (channels of a pixel adjacent, cuDNN's native
layout for convolutions), and the output keeps it.
``torch_channel_norm`` is the reference on tensors. Kernels run on CUDA tensors, or on CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first import); without
Triton the module imports and ``channel_norm`` raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.layers.triton_support import HAS_TRITON, INTERPRET, check_runnable, tl, triton

__all__ = ["INTERPRET", "channel_norm", "torch_channel_norm"]

_BLOCK_S = 128  # pixels a program
_BLOCK_C = 32  # channels a tile
_EPS = 1e-12  # F.normalize's floor on the norm


def torch_channel_norm(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    """``x [B, C, ...]`` divided by each pixel's norm over ``C`` (at least 1e-12), times
    ``weight [C]``, then SiLU when ``silu``; computed in float32, returned in ``x``'s dtype."""
    y = F.normalize(x.float(), dim=1) * weight.float().view(-1, *([1] * (x.ndim - 2)))
    return (F.silu(y) if silu else y).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _channel_norm_kernel(x_ptr, w_ptr, out_ptr, pixels, stride_c, stride_s, channels: tl.constexpr,
                             SILU: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        blocks = tl.cdiv(pixels, BLOCK_S)
        row = tl.program_id(0) // blocks
        s = (tl.program_id(0) % blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
        inside = s < pixels
        base = row.to(tl.int64) * channels * pixels
        squares = tl.zeros([BLOCK_S], dtype=tl.float32)
        for c0 in range(0, channels, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask = (c < channels)[:, None] & inside[None, :]
            at = base + c.to(tl.int64)[:, None] * stride_c + s.to(tl.int64)[None, :] * stride_s
            v = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
            squares += tl.sum(v * v, axis=0)
        inv = 1.0 / tl.maximum(tl.sqrt(squares), 1e-12)
        for c0 in range(0, channels, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask = (c < channels)[:, None] & inside[None, :]
            at = base + c.to(tl.int64)[:, None] * stride_c + s.to(tl.int64)[None, :] * stride_s
            v = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < channels, other=0.0).to(tl.float32)
            y = v * inv[None, :] * w[:, None]
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


def channel_norm(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    """``torch_channel_norm`` in one kernel: ``x [B, C, ...]``, contiguous or channels-last (any
    other layout is made contiguous), ``weight`` ``C`` values (any shape). The output has ``x``'s
    layout."""
    check_runnable(x, "the channel norm kernel", __name__)
    b, c = x.shape[:2]
    if channels_last(x):
        stride_c, stride_s = 1, c
    else:
        x = x.contiguous()
        stride_c, stride_s = x[0, 0].numel(), 1
    pixels = x[0, 0].numel()
    weight = weight.reshape(c).contiguous()
    out = torch.empty_like(x)  # the same strides as x: a dense tensor keeps its layout
    if x.numel():
        grid = (b * triton.cdiv(pixels, _BLOCK_S),)
        _channel_norm_kernel[grid](x, weight, out, pixels, stride_c, stride_s, channels=c, SILU=silu,
                                   BLOCK_S=_BLOCK_S, BLOCK_C=_BLOCK_C)
    return out


def channels_last(x: torch.Tensor) -> bool:
    """Whether ``x [B, C, ...]`` is dense with its channels innermost (``[B, ..., C]`` contiguous)
    and not also contiguous (one channel, or one pixel, is both; it is read as contiguous)."""
    if x.is_contiguous() or x.ndim < 3:
        return False
    return x.movedim(1, -1).is_contiguous()
