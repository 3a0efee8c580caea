"""Style-modulated instance norm, activation and padding mask in three Triton passes.

The StyleTTS2/iSTFTNet vocoders (Kokoro, and the HiFT family's residual blocks) spend most of
their GPU time in one element-wise chain on ``[B, C, T]`` tensors at audio rate: instance-norm
statistics over each row's valid frames, ``(1 + gamma) * norm(x) + beta`` from the style,
Snake (``y + sin(a y)^2 / a``) or leaky ReLU, and zeros past each row's end before the next
convolution. Run op by op that is ~30 passes over a tensor that, for 32 rows of 25 s of speech
at 64 channels, is ~1 GB; ``adain_act`` makes it three reads and one write, each kernel on a
grid of ``(row, channel) x block of frames`` programs: block sums give each row's mean, block
sums of squared distances from it the variance (two passes, as the torch reference does, so a
large mean does not cost precision); norm, affine and style fold into one scale and shift per
``(row, channel)``, and the last pass writes the activated, masked result.

``torch_adain_act`` is the reference on tensors (the eager modules compute the same thing
with their own rounding points). Kernels run on CUDA tensors, or on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` set before the first import); without Triton the module
imports and ``adain_act`` raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.layers.triton_support import HAS_TRITON, INTERPRET, check_runnable, tl, triton

__all__ = ["INTERPRET", "adain_act", "torch_adain_act"]

_BLOCK = 1024  # frames per loop iteration of a program
_ACTS = {None: 0, "snake": 1, "leaky_relu": 2}


def torch_adain_act(x: torch.Tensor, keep: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float, gamma: torch.Tensor, beta: torch.Tensor, act: str | None = None,
                    alpha: torch.Tensor | None = None, slope: float = 0.2) -> torch.Tensor:
    """``x [B, C, T]``; ``keep [B, T]`` the valid frames (``None``: all); ``weight``/``bias``
    ``[C]`` the norm's affine; ``gamma``/``beta`` ``[B, C]`` from the style; ``act`` ``None``,
    ``"snake"`` (``alpha [C]``) or ``"leaky_relu"`` (``slope``). Frames past a row's end are 0."""
    xf = x.float()
    valid = torch.ones_like(xf[:, :1], dtype=torch.bool) if keep is None else keep[:, None]
    count = valid.sum(-1, keepdim=True).float()
    mean = torch.where(valid, xf, 0.0).sum(-1, keepdim=True) / count
    var = torch.where(valid, xf - mean, 0.0).pow(2).sum(-1, keepdim=True) / count
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.float()[:, None] + bias.float()[:, None]
    y = (1 + gamma.float()[..., None]) * y + beta.float()[..., None]
    if act == "snake":
        a = alpha.float().reshape(1, -1, 1)
        y = y + (1 / a) * torch.sin(a * y) ** 2
    elif act == "leaky_relu":
        y = F.leaky_relu(y, slope)
    return torch.where(valid, y, 0.0).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _frame_block(keep_ptr, program, channels, frames, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
        """The offsets of this program's frames in ``x`` and in ``keep``, and which count."""
        row = program // tl.cdiv(frames, BLOCK)  # b * channels + c
        t = (program % tl.cdiv(frames, BLOCK)) * BLOCK + tl.arange(0, BLOCK)
        inside = t < frames
        valid = inside
        if HAS_KEEP:
            kept = tl.load(keep_ptr + (row // channels).to(tl.int64) * frames + t, mask=inside, other=0)
            valid = inside & (kept != 0)
        return row, row.to(tl.int64) * frames + t, inside, valid

    @triton.jit
    def _partial_sums_kernel(x_ptr, keep_ptr, mean_ptr, out_ptr, channels, frames, HAS_KEEP: tl.constexpr,
                             CENTRED: tl.constexpr, BLOCK: tl.constexpr):
        """Per (row, block of frames): the sum of the valid ``x``, or (``CENTRED``) of their
        squared distances from the row's mean."""
        program = tl.program_id(0)
        row, at, inside, valid = _frame_block(keep_ptr, program, channels, frames, HAS_KEEP, BLOCK)
        v = tl.load(x_ptr + at, mask=valid, other=0.0).to(tl.float32)
        if CENTRED:
            v = tl.where(valid, v - tl.load(mean_ptr + row), 0.0)
            v = v * v
        tl.store(out_ptr + program, tl.sum(v, axis=0))

    @triton.jit
    def _apply_kernel(x_ptr, keep_ptr, out_ptr, scale_ptr, shift_ptr, alpha_ptr, channels, frames, slope,
                      HAS_KEEP: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
        """``act(x * scale + shift)`` per row, zero at the frames ``keep`` drops."""
        row, at, inside, valid = _frame_block(keep_ptr, tl.program_id(0), channels, frames, HAS_KEEP, BLOCK)
        y = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32) * tl.load(scale_ptr + row) \
            + tl.load(shift_ptr + row)
        if ACT == 1:
            a = tl.load(alpha_ptr + row % channels).to(tl.float32)
            s = tl.sin(a * y)
            y = y + s * s / a
        elif ACT == 2:
            y = tl.where(y >= 0, y, y * slope)
        y = tl.where(valid, y, 0.0)
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=inside)


def adain_act(x: torch.Tensor, keep: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
              gamma: torch.Tensor, beta: torch.Tensor, act: str | None = None, alpha: torch.Tensor | None = None,
              slope: float = 0.2) -> torch.Tensor:
    """``torch_adain_act`` in three kernels over ``x`` (same arguments): block sums for the
    mean, block sums of squared distances for the variance, then one pass that applies norm,
    style, activation and mask (the per-row scale and shift folded on ``[B, C]`` in between)."""
    check_runnable(x, "the AdaIN + activation kernels", __name__)
    if act not in _ACTS:
        raise ValueError(f"act must be one of {sorted(_ACTS, key=str)}, got {act!r}")
    if act == "snake" and alpha is None:
        raise ValueError("act='snake' needs alpha")
    rows, channels, frames = x.shape
    x = x.contiguous()
    blocks = triton.cdiv(frames, _BLOCK)
    grid = (rows * channels * blocks,)
    keep_bytes = keep.contiguous().view(torch.uint8) if keep is not None else x  # unused without keep
    count = (torch.full((rows, 1), float(frames), device=x.device) if keep is None
             else keep.sum(-1, keepdim=True, dtype=torch.float32))  # [B, 1]
    partial = torch.empty(rows * channels * blocks, device=x.device, dtype=torch.float32)
    _partial_sums_kernel[grid](x, keep_bytes, partial, partial, channels, frames, HAS_KEEP=keep is not None,
                               CENTRED=False, BLOCK=_BLOCK)
    mean = (partial.view(rows, channels, blocks).sum(-1) / count).contiguous()  # [B, C]
    _partial_sums_kernel[grid](x, keep_bytes, mean, partial, channels, frames, HAS_KEEP=keep is not None,
                               CENTRED=True, BLOCK=_BLOCK)
    var = partial.view(rows, channels, blocks).sum(-1) / count
    style = 1 + gamma.float().reshape(rows, channels)
    scale = torch.rsqrt(var + eps) * weight.float() * style
    shift = (bias.float() * style + beta.float().reshape(rows, channels) - mean * scale).contiguous()
    out = torch.empty_like(x)
    alpha_flat = alpha.reshape(-1).contiguous() if alpha is not None else scale
    _apply_kernel[grid](x, keep_bytes, out, scale.contiguous(), shift, alpha_flat, channels, frames, float(slope),
                        HAS_KEEP=keep is not None, ACT=_ACTS[act], BLOCK=_BLOCK)
    return out
