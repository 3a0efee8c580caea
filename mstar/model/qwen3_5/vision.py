"""The Qwen3.5 ViT tower: flattened pixel patches of many images and videos in, one
language-model embedding per merged 2x2 block of patches out.

Input rows are patches already laid out by the processor (``mstar.model.qwen3_5.processor``):
media after media, frame group after frame group, and inside a group in spatial-merge-block
order (each run of ``merge**2`` rows is one merged token). Each patch gets a learned
position embedding resampled (bilinear, corners aligned) from a square table to its media's
grid, and a 2D rotary position (its row and column); every frame group attends only to
itself, so a batch of media from many requests runs as one forward. Parameter names are
those of the checkpoint under ``model.visual.``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.rotary import apply_rotary, cos_sin_tables
from mstar.model.qwen3_5.config import Qwen3_5VisionConfig


class PatchEmbed(nn.Module):
    """A 3D convolution whose kernel equals its stride equals one patch: a linear map of
    each flattened patch (kept as ``proj``, the checkpoint's Conv3d weight)."""

    def __init__(self, config: Qwen3_5VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: Qwen3_5VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin, float32=True), apply_rotary(k, cos, sin, float32=True)
        return self.proj(segments.attention(q, k, v).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Qwen3_5VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: Qwen3_5VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each ``merge**2`` block of patches concatenated and mapped
    by a GELU MLP to the language model's width."""

    def __init__(self, config: Qwen3_5VisionConfig) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Segments:
    """The attention segments of a packed batch: one per frame group of every media.
    Segments of equal length run as one batched attention (shape bucketing)."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        starts: dict[int, list[int]] = defaultdict(list)
        offset = 0
        for length in lengths:
            starts[length].append(offset)
            offset += length
        self.buckets = [(length, (torch.tensor(s)[:, None] + torch.arange(length)).reshape(-1).to(device))
                        for length, s in starts.items()]
        self.single = len(lengths) == 1

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention within each segment: ``[N, H, D]`` in and out."""
        heads, dim = q.shape[1:]
        if self.single:
            # 4-D: SDPA's fused kernels take no 3-D inputs (the math fallback holds every score)
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
            return out[0].transpose(0, 1)
        out = torch.empty_like(q)
        for length, index in self.buckets:  # [segments, H, length, D] per tensor
            q_seg, k_seg, v_seg = [t[index].view(-1, length, heads, dim).transpose(1, 2) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg)
            out[index] = o.transpose(1, 2).reshape(-1, heads, dim)
        return out


class Qwen3_5VisionModel(nn.Module):
    """``forward(patches [N, patch_dim], grid_thw [M, 3])`` -> ``[N / merge**2, out_hidden]``
    (media in order; media ``i`` yields ``t * h * w / merge**2`` rows)."""

    def __init__(self, config: Qwen3_5VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        quarter = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]) -> torch.Tensor:
        x, cos_sin, segments = self.embed(patches, grid_thw)
        for block in self.blocks:
            x = block(x, cos_sin, segments)
        return self.merger(x)

    def embed(self, patches: torch.Tensor, grid_thw: torch.Tensor | list[list[int]]
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], Segments]:
        """What the blocks run on: the patch embeddings plus their learned positions ``[N,
        hidden]``, the rotary cos/sin of every patch and the attention segments."""
        grids = [tuple(int(v) for v in g) for g in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape[0] != expected:
            raise ValueError(f"{patches.shape[0]} patches for grids {grids} (expected {expected})")
        x = self.patch_embed(patches)
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos_sin = self.rotary(grids, x.device)
        return x, cos_sin, Segments([h * w for t, h, w in grids for _ in range(t)], x.device)

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.config.spatial_merge_size**2

    def _block_order(self, grid2d: torch.Tensor) -> torch.Tensor:
        """``[h, w, ...]`` -> ``[h * w, ...]`` in spatial-merge-block order."""
        h, w = grid2d.shape[:2]
        m = self.config.spatial_merge_size
        blocks = grid2d.reshape(h // m, m, w // m, m, *grid2d.shape[2:]).transpose(1, 2)
        return blocks.reshape(h * w, *grid2d.shape[2:])

    def position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned ``side x side`` table resampled bilinearly (corners aligned) to each
        grid, repeated over its frame groups."""
        table = self.pos_embed.weight
        side = int(self.config.num_position_embeddings**0.5)
        out = []
        for t, h, w in grids:
            (h0, h1, hf), (w0, w1, wf) = _taps(h, side, table.device), _taps(w, side, table.device)
            grid = ((1 - hf)[:, None, None] * ((1 - wf)[None, :, None] * table[(h0[:, None] * side + w0)]
                                               + wf[None, :, None] * table[(h0[:, None] * side + w1)])
                    + hf[:, None, None] * ((1 - wf)[None, :, None] * table[(h1[:, None] * side + w0)]
                                           + wf[None, :, None] * table[(h1[:, None] * side + w1)]))
            out.append(self._block_order(grid).repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[N, head_dim]``: the first half of the frequencies follow the patch's row,
        the second half its column, and the pair is repeated (rotate-half layout)."""
        inv_freq = self.inv_freq.to(device)
        angles = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            rc = self._block_order(torch.stack((rows, cols), dim=-1))  # [h*w, 2]
            freqs = torch.cat((rc[:, :1].float() * inv_freq, rc[:, 1:].float() * inv_freq), dim=-1)
            angles.append(freqs.repeat(t, 1))
        return cos_sin_tables(torch.cat(angles))


def _taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps of ``size`` target points on a ``side``-long axis: the
    lower and upper source index and the upper one's weight."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    low = src.floor()
    frac = src - low
    low = low.long()
    return low, (low + 1).clamp(max=side - 1), frac
