"""Qwen3-Omni's vision encoder: flattened pixel patches of many images in, one thinker
embedding per merged 2x2 block of patches out, plus the deepstack features.

The tower is Qwen3.5's (``mstar.model.qwen3_5.vision``: patch embedding, learned positions
resampled to each grid, 2D rotary positions, blocks attending within each frame group); only
the outputs differ. Besides the final merger (LayerNorm per patch, then the ``merge**2``
block's concatenation through a GELU MLP), every block named in ``deepstack_visual_indexes``
feeds a merger of its own whose LayerNorm runs over the concatenated block instead. The
thinker adds deepstack feature ``i`` to the image tokens' hidden states after its decoder
layer ``i`` (the first ``len(deepstack_visual_indexes)`` layers; the indexes name vision
blocks, not decoder layers).

Parameter names are the released checkpoint's ``thinker.visual.`` keys (``merger.ln_q``,
``merger.mlp.0`` / ``mlp.2``, ``merger_list.{i}.…``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.qwen3_5.config import Qwen3_5VisionConfig
from mstar.model.qwen3_5.vision import PatchEmbed, Qwen3_5VisionModel, VisionBlock


@dataclass
class Qwen3OmniVisionConfig(Qwen3_5VisionConfig):
    """The tower's hyper-parameters (``thinker_config.vision_config``), the thinker's image and
    video token ids and ``position_id_per_seconds`` (top level of ``thinker_config``); defaults
    follow transformers' Omni configs."""

    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    position_id_per_seconds: float = 25  # a video's temporal positions per second (the thinker config's)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.deepstack_visual_indexes = list(self.deepstack_visual_indexes)
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} are not blocks of a depth-{self.depth} tower")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniVisionConfig:
        """From a whole Omni (``thinker_config``) or a thinker ``config.json`` dict."""
        d = d.get("thinker_config", d)
        if not d.get("vision_config"):
            raise ValueError("the thinker config has no vision_config")
        config = super().from_hf_dict(d)
        if d.get("position_id_per_seconds") is not None:
            config.position_id_per_seconds = d["position_id_per_seconds"]
        return config


class OmniPatchMerger(nn.Module):
    """A ``merge**2`` block of patches -> one thinker embedding: LayerNorm (per patch, or over
    the concatenated block with ``norm_merged``), then Linear, GELU, Linear."""

    def __init__(self, config: Qwen3OmniVisionConfig, norm_merged: bool) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.norm_merged = norm_merged
        self.ln_q = nn.LayerNorm(self.merged if norm_merged else config.hidden_size, eps=1e-6)
        self.mlp = nn.ModuleList([nn.Linear(self.merged, self.merged), nn.GELU(),
                                  nn.Linear(self.merged, config.out_hidden_size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.view(-1, self.merged)) if self.norm_merged else self.ln_q(x).view(-1, self.merged)
        return self.mlp[2](F.gelu(self.mlp[0](x)))


@dataclass
class VisionFeatures:
    """The encoder's output for a batch of images, rows in image order."""

    embeds: torch.Tensor  # [N, out_hidden]: spliced over the image pad tokens
    deepstack: list[torch.Tensor]  # per deepstack layer, [N, out_hidden]


class Qwen3OmniVisionEncoder(Qwen3_5VisionModel):
    """``forward(patches [P, patch_dim], grid_thw [M, 3])`` -> ``VisionFeatures`` of
    ``P / merge**2`` rows (image ``i`` yields ``t * h * w / merge**2`` of them)."""

    def __init__(self, config: Qwen3OmniVisionConfig) -> None:
        nn.Module.__init__(self)  # Qwen3.5's merger has other names and no deepstack
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = OmniPatchMerger(config, norm_merged=False)
        self.merger_list = nn.ModuleList(OmniPatchMerger(config, norm_merged=True)
                                         for _ in config.deepstack_visual_indexes)
        quarter = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> VisionFeatures:
        x, cos_sin, segments = self.embed(patches, grid_thw)
        taps = {block: i for i, block in enumerate(self.config.deepstack_visual_indexes)}
        deepstack: list[torch.Tensor | None] = [None] * len(taps)
        for index, block in enumerate(self.blocks):
            x = block(x, cos_sin, segments)
            if index in taps:
                deepstack[taps[index]] = self.merger_list[taps[index]](x)
        return VisionFeatures(self.merger(x), deepstack)
