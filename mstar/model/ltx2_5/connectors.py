"""The text connectors: the Gemma encoder's hidden states (every layer's, stacked) -> the prompt
features the DiT's video and audio streams cross-attend to.

Parameter names equal the keys of diffusers' ``LTX2TextConnectors`` (0.42.1), so a
checkpoint's ``connectors/`` folder loads by name. Two feature extractors:

* LTX-2.0: each prompt's per-layer states are centred by their masked mean and divided by
  their masked range (over tokens and channels), times 8, padding zeroed; one projection for
  both streams.
* LTX-2.3 and later (``per_modality_projections``): each token's state in each layer is RMS
  normalised, padding zeroed, and scaled by ``sqrt(stream width / encoder width)`` before one
  projection per stream.

Each stream then runs a small 1D transformer (rotary positions over the token index): the
prompt's real tokens are moved to the front, the padding replaced by learnt "register" tokens
(tiled by absolute position), and every position attends to every other, so the output has no
padding and its mask is all ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from mstar.model.ltx2_5.rope import LtxRope
from mstar.model.ltx2_5.transformer import FeedForward, LtxAttention, rms_norm


@dataclass(frozen=True)
class LtxConnectorsConfig:
    """Keys of diffusers' ``LTX2TextConnectors`` ``config.json``."""

    caption_channels: int = 3840  # the encoder's hidden size
    text_proj_in_factor: int = 49  # hidden states per token: the embeddings + one per layer
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LtxConnectorsConfig:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if not k.startswith("_")}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LTX2TextConnectors config keys: {unknown}")
        config = cls(**kwargs)
        for side in ("video", "audio"):
            if getattr(config, f"{side}_connector_num_learnable_registers") is None:
                raise ValueError(f"connectors config: {side}_connector_num_learnable_registers is null; only "
                                 "connectors with registers are supported")
        return config


class ConnectorBlock(nn.Module):
    """Pre-norm (weightless RMS) self-attention and feed-forward."""

    def __init__(self, dim: int, heads: int, head_dim: int, gated: bool) -> None:
        super().__init__()
        self.attn1 = LtxAttention(dim, dim, heads, head_dim, bias=True, out_bias=True, gated=gated)
        self.ff = FeedForward(dim, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn1(rms_norm(x, 1e-6), q_rope=rope)
        return x + self.ff(rms_norm(x, 1e-6))


class Connector(nn.Module):
    """One stream's 1D transformer with its learnt registers."""

    def __init__(self, c: LtxConnectorsConfig, side: str) -> None:
        super().__init__()
        heads = getattr(c, f"{side}_connector_num_attention_heads")
        head_dim = getattr(c, f"{side}_connector_attention_head_dim")
        dim = heads * head_dim
        registers = getattr(c, f"{side}_connector_num_learnable_registers")
        self.learnable_registers = nn.Parameter(torch.rand(registers, dim) * 2.0 - 1.0)
        self.rope = LtxRope(dim, (c.connector_rope_base_seq_len,), c.rope_theta, c.rope_type, heads,
                            c.rope_double_precision)
        gated = getattr(c, f"{side}_gated_attn")
        self.transformer_blocks = nn.ModuleList(
            ConnectorBlock(dim, heads, head_dim, gated) for _ in range(getattr(c, f"{side}_connector_num_layers")))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]``, ``mask [B, L]`` (1 = a real token) -> ``[B, L, D]``, no padding."""
        b, length, _ = x.shape
        count = self.learnable_registers.shape[0]
        if length % count:
            raise ValueError(f"prompt length {length} must be a multiple of the {count} connector registers")
        keep = mask.to(torch.int64)
        order = torch.argsort(1 - keep, dim=1, stable=True)  # real tokens first, in order
        front = torch.gather(x, 1, order[..., None].expand(-1, -1, x.shape[-1]))
        real = torch.arange(length, device=x.device)[None] < keep.sum(dim=1, keepdim=True)
        registers = self.learnable_registers.repeat(length // count, 1).to(x.dtype)
        x = torch.where(real[..., None], front, registers[None])
        positions = torch.arange(length, dtype=torch.float32, device=x.device)[None, None].expand(b, 1, length)
        rope = self.rope(positions)
        for block in self.transformer_blocks:
            x = block(x, rope)
        return rms_norm(x, 1e-6)


def masked_range_norm(states: torch.Tensor, mask: torch.Tensor, scale: float = 8.0,
                      eps: float = 1e-6) -> torch.Tensor:
    """LTX-2.0's features: ``states [B, L, C, layers]`` centred by each prompt's per-layer mean
    over its real tokens and channels, divided by their range, times ``scale``; flattened to
    ``[B, L, C * layers]`` with padding zeroed. ``mask [B, L]`` marks real tokens."""
    keep = mask.bool()[:, :, None, None]
    count = (mask.sum(dim=1) * states.shape[2]).view(-1, 1, 1, 1)
    mean = states.masked_fill(~keep, 0.0).sum(dim=(1, 2), keepdim=True) / (count + eps)
    low = states.masked_fill(~keep, float("inf")).amin(dim=(1, 2), keepdim=True)
    high = states.masked_fill(~keep, float("-inf")).amax(dim=(1, 2), keepdim=True)
    out = ((states - mean) / (high - low + eps) * scale).flatten(2)
    return out.masked_fill(~keep[..., 0], 0.0)


class LtxTextConnectors(nn.Module):
    def __init__(self, config: LtxConnectorsConfig) -> None:
        super().__init__()
        c = self.config = config
        width = c.caption_channels * c.text_proj_in_factor
        if c.per_modality_projections:
            self.video_text_proj_in = nn.Linear(width, c.video_hidden_dim, bias=c.proj_bias)
            self.audio_text_proj_in = nn.Linear(width, c.audio_hidden_dim, bias=c.proj_bias)
        else:
            self.text_proj_in = nn.Linear(width, c.caption_channels, bias=c.proj_bias)
        self.video_connector = Connector(c, "video")
        self.audio_connector = Connector(c, "audio")

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``states [B, L, C, layers]`` (or flattened ``[B, L, C * layers]``, channel-major) the
        encoder's stacked hidden states of a left-padded prompt, ``mask [B, L]``. Returns the
        video and audio prompt features and their mask (all ones: the registers fill the
        padding)."""
        c = self.config
        if states.ndim == 3:
            states = states.unflatten(2, (c.caption_channels, -1))
        if c.per_modality_projections:
            normed = states * torch.rsqrt(states.pow(2).mean(dim=2, keepdim=True) + 1e-6)
            normed = normed.flatten(2) * mask.bool()[..., None]
            video = self.video_text_proj_in(normed * math.sqrt(c.video_hidden_dim / c.caption_channels))
            audio = self.audio_text_proj_in(normed * math.sqrt(c.audio_hidden_dim / c.caption_channels))
        else:
            video = audio = self.text_proj_in(masked_range_norm(states, mask).to(states.dtype))
        video = self.video_connector(video, mask)
        audio = self.audio_connector(audio, mask)
        return video, audio, torch.ones_like(mask, dtype=torch.int64)
