"""Command A+'s image encoder: a SigLIP tower over 512x512 tiles and the projector that turns
each tile's patches into text tokens.

The tower is SigLIP's (``model.vision_tower``: a patch convolution, a learned position per
patch, the shared ``mstar.model.siglip`` encoder, a final LayerNorm; the released pooling
``head`` is not used). The projector (``model.multi_modal_projector``) folds each 2x2 block of
patches into one vector (a pixel shuffle: ``[32, 32, D] -> [16, 16, 4D]`` for a 512 tile),
then ``linear_2(silu(gate) * x)`` where ``[x | gate] = linear_1(.)``: 256 tokens a tile."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.command_a_plus.config import CommandVisionConfig
from mstar.model.siglip import SiglipEncoder


class VisionEmbeddings(nn.Module):
    def __init__(self, config: CommandVisionConfig) -> None:
        super().__init__()
        grid = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(grid * grid, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [tiles, 3, S, S]`` -> ``[tiles, patches, hidden]``."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class VisionTower(nn.Module):
    """SigLIP over whole tiles (each attends to its own patches); the last hidden states."""

    def __init__(self, config: CommandVisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = SiglipEncoder(config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                     config.num_hidden_layers, config.layer_norm_eps)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))


class MultiModalProjector(nn.Module):
    def __init__(self, config: CommandVisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.factor = config.downsample_factor
        self.linear_1 = nn.Linear(config.hidden_size * self.factor**2, config.alignment_intermediate_size)
        self.linear_2 = nn.Linear(config.alignment_intermediate_size // 2, text_hidden)

    def pixel_shuffle(self, features: torch.Tensor) -> torch.Tensor:
        """``[tiles, g * g, D] -> [tiles, g / f, g / f, f * f * D]``, in transformers' channel
        order (the grid's first axis folded first, then its second)."""
        tiles, patches, dim = features.shape
        grid, f = int(patches**0.5), self.factor
        x = features.reshape(tiles, grid, grid // f, dim * f).permute(0, 2, 1, 3)
        return x.reshape(tiles, grid // f, grid // f, -1).permute(0, 2, 1, 3)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x, gate = self.linear_1(self.pixel_shuffle(features)).chunk(2, dim=-1)
        return self.linear_2(F.silu(gate) * x)


class CommandVision(nn.Module):
    """Tiles ``[n, 3, S, S]`` (``processor.tile_image``) -> text embeddings ``[n * tokens_per_tile,
    text_hidden]``, tile by tile, row-major within a tile."""

    def __init__(self, config: CommandVisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.vision_tower = VisionTower(config)
        self.multi_modal_projector = MultiModalProjector(config, text_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.multi_modal_projector(self.vision_tower(pixels))
        return out.reshape(-1, out.shape[-1])
