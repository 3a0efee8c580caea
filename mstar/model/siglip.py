"""SigLIP's vision encoder layers, shared by the families that read images through a SigLIP
tower (Pi0.5's PaliGemma, BAGEL's NaViT): pre-norm blocks of full (non-causal) multi-head
attention with biased projections and a tanh-GELU MLP, under the released names
(``layers.N.self_attn.{q,k,v,out}_proj``, ``layer_norm1/2``, ``mlp.fc1/fc2``).

A family keeps its own patch embedding and position scheme (square images with a learned
table, or packed images of any size) and calls ``SiglipEncoder`` on the embedded patches:
``[images, tokens, hidden]`` for equal-sized images, each attending to its own tokens, or
packed ``[tokens, hidden]`` with ``lengths`` (each image's token count, in order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """``x [images, tokens, hidden]``, or packed ``[tokens, hidden]`` with ``lengths``."""
        batched = x.dim() == 3
        rows = x if batched else x[None]
        n, t, hidden = rows.shape
        q, k, v = (proj(rows).view(n, t, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if batched:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            if lengths is None or sum(lengths) != t:
                raise ValueError(f"packed SigLIP input of {t} tokens needs each image's length, got {lengths}")
            out = torch.empty_like(q)
            start = 0
            for length in lengths:  # each image attends to its own patches
                end = start + length
                out[..., start:end, :] = F.scaled_dot_product_attention(
                    q[..., start:end, :], k[..., start:end, :], v[..., start:end, :])
                start = end
        out = self.out_proj(out.transpose(1, 2).reshape(n, t, hidden))
        return out if batched else out[0]


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = SiglipAttention(hidden, heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = SiglipMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), lengths)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    """``encoder``: ``num_layers`` blocks; ``forward(x, lengths=None)`` as ``SiglipAttention``."""

    def __init__(self, hidden: int, heads: int, intermediate: int, num_layers: int, eps: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(hidden, heads, intermediate, eps) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, lengths)
        return x
