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
layout for convolutions), and the output keeps it; the output may also be a slice of a larger
buffer (a causal convolution's input with its past frames in front, so no concatenation copies
the activation again).
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
    def _channel_norm_kernel(x_ptr, w_ptr, out_ptr, pixels, x_b, x_c, x_s, out_b, out_c, out_s,
                             channels: tl.constexpr, SILU: tl.constexpr, BLOCK_S: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        blocks = tl.cdiv(pixels, BLOCK_S)
        row = (tl.program_id(0) // blocks).to(tl.int64)
        s = ((tl.program_id(0) % blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
        inside = s < pixels
        squares = tl.zeros([BLOCK_S], dtype=tl.float32)
        for c0 in range(0, channels, BLOCK_C):
            c = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
            mask = (c < channels)[:, None] & inside[None, :]
            v = tl.load(x_ptr + row * x_b + c[:, None] * x_c + s[None, :] * x_s, mask=mask, other=0.0).to(tl.float32)
            squares += tl.sum(v * v, axis=0)
        inv = 1.0 / tl.maximum(tl.sqrt(squares), 1e-12)
        for c0 in range(0, channels, BLOCK_C):
            c = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
            mask = (c < channels)[:, None] & inside[None, :]
            v = tl.load(x_ptr + row * x_b + c[:, None] * x_c + s[None, :] * x_s, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < channels, other=0.0).to(tl.float32)
            y = v * inv[None, :] * w[:, None]
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            tl.store(out_ptr + row * out_b + c[:, None] * out_c + s[None, :] * out_s,
                     y.to(out_ptr.dtype.element_ty), mask=mask)


def channel_norm(x: torch.Tensor, weight: torch.Tensor, silu: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch_channel_norm`` in one kernel: ``x [B, C, ...]``, ``weight`` ``C`` values (any shape).
    ``out``: where to write (``x``'s shape and dtype), e.g. a slice of a larger buffer; by default
    a new tensor in ``x``'s layout. Either may be contiguous, channels-last, or a slice along the
    first pixel dimension (frames) of either; any other layout of ``x`` is read through a copy."""
    check_runnable(x, "the channel norm kernel", __name__)
    b, c = x.shape[:2]
    pixels = x[0, 0].numel() if x.numel() else 0
    if pixel_strides(x) is None:
        x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)  # the same strides as x: a dense tensor keeps its layout
    elif out.shape != x.shape or out.dtype != x.dtype or pixel_strides(out) is None:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} (layout {out.stride()}) cannot hold the norm "
                         f"of {tuple(x.shape)} {x.dtype}")
    weight = weight.reshape(c).contiguous()
    if pixels:
        grid = (b * triton.cdiv(pixels, _BLOCK_S),)
        _channel_norm_kernel[grid](x, weight, out, pixels, *pixel_strides(x), *pixel_strides(out), channels=c,
                                   SILU=silu, BLOCK_S=_BLOCK_S, BLOCK_C=_BLOCK_C)
    return out


def pixel_strides(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(batch, channel, pixel)`` strides of ``x [B, C, ...]`` when its pixels (every dimension
    after ``C``, flattened) sit at one stride from each other, else None."""
    step = x.stride(-1) if x.ndim > 2 else 1
    expected = step
    for size, stride in zip(reversed(x.shape[2:]), reversed(x.stride()[2:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return x.stride(0), x.stride(1), step


def channels_last(x: torch.Tensor) -> bool:
    """Whether ``x [B, C, ...]`` is dense with its channels innermost (``[B, ..., C]`` contiguous)
    and not also contiguous (one channel, or one pixel, is both; it is read as contiguous)."""
    if x.is_contiguous() or x.ndim < 3:
        return False
    return x.movedim(1, -1).is_contiguous()
