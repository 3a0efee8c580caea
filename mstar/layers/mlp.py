"""Feed-forward blocks shared by decoder families (tensor-parallel through
``mstar.layers.linear``; plain ``nn.Linear`` layers outside a parallel state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

GATE_UP = ("gate_proj", "up_proj")


@torch.library.custom_op("mstar::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x W^T + b)``. On CUDA one cuBLASLt product whose epilogue adds the bias and
    applies the tanh GELU as it stores (``torch._addmm_activation``): the hidden activation is
    written once, not written, read and written again by a separate GELU pass. The epilogue
    rounds once where the two-pass path rounds the product before the GELU, so the results
    agree to the dtype's rounding, not bit for bit. Elsewhere it is the two-pass path.

    A ``torch.library`` custom op, so inductor calls it as one opaque kernel instead of
    splitting the bias and GELU back out into its own element-wise kernel."""
    if not x.is_cuda:
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_gelu_tanh.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, with the Hugging Face parameter names
    (``gate_proj``, ``up_proj``, ``down_proj``) Llama, Qwen and their kin use.

    With ``fused``, gate and up are one GEMM (``gate_up_proj``, segments ``[gate | up]``); it
    still loads from a checkpoint storing ``gate_proj`` and ``up_proj`` apart, through the
    layer's segment loader (see ``MergedColumnParallelLinear``), but its state dict differs
    from the unfused one.

    Under tensor parallelism each rank holds a slice of the ``inner`` features (gate and up
    split by output, down by input) and ``down_proj`` sums the partial outputs.

    With ``fused`` and ``fused_kernels`` set, ``silu(gate) * up`` is one Triton kernel on the
    ``gate_up_proj`` output (``mstar.layers.triton_fused.silu_and_mul``)."""

    fused_kernels: bool = False

    def __init__(self, hidden: int, inner: int, bias: bool = False, *, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up_proj = MergedColumnParallelLinear(hidden, [inner, inner], bias=bias, segment_names=GATE_UP)
        else:
            self.gate_proj = ColumnParallelLinear(hidden, inner, bias=bias)
            self.up_proj = ColumnParallelLinear(hidden, inner, bias=bias)
        self.down_proj = RowParallelLinear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate_up = self.gate_up_proj(x)
            if self.fused_kernels:
                from mstar.layers.triton_fused import silu_and_mul

                return self.down_proj(silu_and_mul(gate_up))
            gate, up = self.gate_up_proj.split_output(gate_up)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class TextProjection(nn.Module):
    """``linear_2(gelu_tanh(linear_1(x)))``: a diffusion DiT's prompt features into its width
    (PixArt-alpha's caption projection; diffusers' ``PixArtAlphaTextProjection`` key names)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))
