"""Per-head RMS QK-norm and interleaved rotary embedding in one Triton kernel.

A FLUX.2 DiT block normalises every head of ``q`` and ``k`` (RMSNorm over the head's channels,
with a learned scale) and then rotates adjacent channel pairs ``(2j, 2j + 1)`` by per-token
angles. Compiled by inductor this was one reduction kernel per tensor that read each row's
pair partners a second time: at 1024x1024 it took ~190 us per single-stream block for q and
k, against ~30 us for streaming them once. ``qk_norm_rope`` does both in one pass: a program
loads a tile of rows ``[rows, head_dim]``, splits it into even and odd channels, takes the
fp32 mean square, scales, rounds to the input dtype (where the module-by-module torch path
rounds, between ``nn.RMSNorm`` and the rotation), rotates in fp32 and stores the rounded
result.

The input may be a strided view (the single-stream block's q and k are slices of one fused
projection's output): only the channel stride must be 1 and the batch and token dimensions
must merge into one stride. The output is contiguous ``[B, S, H, head_dim]``.

``qk_norm_rope`` is a ``torch.library`` custom op (``mstar::qk_norm_rope``), so a compiled
DiT calls the kernel without a graph break. ``torch_qk_norm_rope`` is the torch reference
with the same rounding points. Kernels run on CUDA tensors, or on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` set before the first import); without Triton the module
imports and the op raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.layers.rotary import apply_rotary_pairs
from mstar.layers.triton_support import (
    HAS_TRITON,
    INTERPRET,
    check_runnable,
    tl,
    triton,
)

_ROWS = 16  # (token, head) rows per program


def torch_qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]``: RMSNorm over ``D`` (fp32 statistics and scale, rounded to ``x``'s
    dtype), then pair ``(x0, x1)`` -> ``(x0 cos - x1 sin, x1 cos + x0 sin)`` in fp32 with
    tables ``[S, D]`` or ``[B, S, D]`` (each angle repeated for both channels of its pair)."""
    return apply_rotary_pairs(F.rms_norm(x, x.shape[-1:], weight, eps), cos, sin)


if HAS_TRITON:

    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rows, heads, tok_stride, head_stride,
                             table_rows, eps, D: tl.constexpr, ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, D)
        mask = (r < rows)[:, None]
        tok = r // heads
        src = (tok.to(tl.int64) * tok_stride + (r % heads) * head_stride)[:, None] + c[None, :]
        x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(w_ptr + c).to(tl.float32)
        normed = (x * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
        table = ((tok % table_rows).to(tl.int64) * D)[:, None] + c[None, :]
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
        even, odd = tl.split(tl.reshape(normed, (ROWS, D // 2, 2)))
        cos_e, _ = tl.split(tl.reshape(cos, (ROWS, D // 2, 2)))
        sin_e, _ = tl.split(tl.reshape(sin, (ROWS, D // 2, 2)))
        out = tl.reshape(tl.join(even * cos_e - odd * sin_e, odd * cos_e + even * sin_e), (ROWS, D))
        dst = r.to(tl.int64)[:, None] * D + c[None, :]
        tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    check_runnable(x, "the QK-norm + RoPE kernel", __name__)
    b, s, h, d = x.shape
    if d & (d - 1) or d < 2:
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if x.stride(-1) != 1 or (b > 1 and x.stride(0) != s * x.stride(1)):
        x = x.contiguous()
    if cos.shape[-2:] != (s, d) or cos.shape != sin.shape or cos.dim() not in (2, 3):
        raise ValueError(f"rope tables must be [S, D] or [B, S, D] for x {list(x.shape)}, got {list(cos.shape)}")
    cos, sin = (t.float().reshape(-1, d).contiguous() for t in (cos, sin))
    out = torch.empty((b, s, h, d), dtype=x.dtype, device=x.device)
    rows = b * s * h
    if rows:
        _qk_norm_rope_kernel[(triton.cdiv(rows, _ROWS),)](
            x, weight, cos, sin, out, rows, h, x.stride(1), x.stride(2), cos.shape[0], eps, D=d, ROWS=_ROWS,
            num_warps=4)
    return out


@torch.library.custom_op("mstar::qk_norm_rope", mutates_args=())
def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``torch_qk_norm_rope(x, weight, eps, cos, sin)`` in one kernel, as a new contiguous
    tensor (``x`` ``[B, S, H, D]`` in bf16, fp16 or fp32; ``D`` a power of two)."""
    return _launch(x, weight, cos, sin, eps)


@qk_norm_rope.register_fake
def _(x, weight, cos, sin, eps):
    return x.new_empty(x.shape)


__all__ = ["HAS_TRITON", "INTERPRET", "qk_norm_rope", "torch_qk_norm_rope"]
