"""Feed-forward blocks shared by decoder families (tensor-parallel through
``mstar.layers.linear``; plain ``nn.Linear`` layers outside a parallel state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import ColumnParallelLinear, RowParallelLinear


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, with the Hugging Face parameter names
    (``gate_proj``, ``up_proj``, ``down_proj``) Llama, Qwen and their kin use.

    Under tensor parallelism each rank holds a slice of the ``inner`` features (gate and up
    split by output, down by input) and ``down_proj`` sums the partial outputs."""

    def __init__(self, hidden: int, inner: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inner, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden, inner, bias=bias)
        self.down_proj = RowParallelLinear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
