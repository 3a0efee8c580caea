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
from torch import nn

from mstar.model.pi05.config import SiglipDims
from mstar.model.siglip import SiglipEncoder


class SiglipEmbeddings(nn.Module):
    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, dims.hidden_size, dims.patch_size, stride=dims.patch_size)
        self.position_embedding = nn.Embedding(dims.tokens_per_image, dims.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # [N, C, h, w]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight[None]


class SiglipVisionModel(nn.Module):
    """``vision_model``: patches -> encoder -> final LayerNorm, ``[N, tokens, hidden]``."""

    def __init__(self, dims: SiglipDims) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(dims)
        self.encoder = SiglipEncoder(dims.hidden_size, dims.num_heads, dims.intermediate_size, dims.num_layers,
                                     dims.layer_norm_eps)
        self.post_layernorm = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))


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
