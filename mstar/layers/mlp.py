"""Feed-forward blocks shared by decoder families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, with the Hugging Face parameter names
    (``gate_proj``, ``up_proj``, ``down_proj``) Llama, Qwen and their kin use."""

    def __init__(self, hidden: int, inner: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
