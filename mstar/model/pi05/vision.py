"""SigLIP (so400m/14, no pooling head) and PaliGemma's projector: camera images -> prefix tokens.

Parameter names follow the released checkpoint under
``paligemma_with_expert.paligemma.model.``: ``vision_tower.vision_model.*`` and
``multi_modal_projector.linear``. Images arrive already resized to the tower's square size and
scaled to [-1, 1] (what PaliGemma's image processor does); each gives ``(size / patch)^2``
tokens of the language model's width, unscaled (the Gemma embedding scale applies to text
tokens only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.pi05.config import SiglipDims


class SiglipEmbeddings(nn.Module):
    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, dims.hidden_size, dims.patch_size, stride=dims.patch_size)
        self.position_embedding = nn.Embedding(dims.tokens_per_image, dims.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # [N, C, h, w]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        hidden = dims.hidden_size
        self.num_heads = dims.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, hidden = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, t, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        return self.out_proj(out.transpose(1, 2).reshape(n, t, hidden))


class SiglipMLP(nn.Module):
    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dims.hidden_size, dims.intermediate_size)
        self.fc2 = nn.Linear(dims.intermediate_size, dims.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)
        self.self_attn = SiglipAttention(dims)
        self.layer_norm2 = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)
        self.mlp = SiglipMLP(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(dims) for _ in range(dims.num_layers))


class SiglipVisionModel(nn.Module):
    """``vision_model``: patches -> encoder -> final LayerNorm, ``[N, tokens, hidden]``."""

    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(dims)
        self.encoder = SiglipEncoder(dims)
        self.post_layernorm = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipVisionTower(nn.Module):
    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.vision_model = SiglipVisionModel(dims)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vision_model(pixels)


class MultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vision_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
