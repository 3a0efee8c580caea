"""The UMT5 encoder (Wan's prompt encoder, UMT5-XXL): a T5 encoder whose every layer learns its
own relative-position bias.

Parameter names equal the state dict keys of transformers' ``UMT5EncoderModel`` (5.x), so a
checkpoint's ``text_encoder/`` folder loads by name; the token embedding is one module under
both of its names (``shared`` and ``encoder.embed_tokens``), as transformers ties them.
T5 conventions: RMS layer norms without bias or mean, no attention scaling, bucketed relative
positions (exact up to a distance, logarithmic beyond, both directions), and a gated GELU
feed-forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class UMT5Config:
    """The keys of a transformers ``UMT5Config`` the encoder needs (UMT5-XXL's values)."""

    vocab_size: int = 256384
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UMT5Config:
        if data.get("feed_forward_proj", "gated-gelu") != "gated-gelu":
            raise ValueError(f"text_encoder config: feed_forward_proj {data['feed_forward_proj']!r} is not "
                             "supported (only 'gated-gelu', UMT5's)")
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in keys})


class T5LayerNorm(nn.Module):
    """``weight * x / rms(x)``, the mean square taken in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def relative_buckets(length: int, buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """``[length, length]`` bucket of key ``j`` seen from query ``i`` (bidirectional): half the
    buckets per direction, exact distances below a quarter of all buckets, log-spaced above."""
    pos = torch.arange(length, device=device)
    rel = pos[None, :] - pos[:, None]
    half = buckets // 2
    out = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    far = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return out + torch.where(rel < exact, rel, far.clamp(max=half - 1))


class UMT5Attention(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        inner = config.num_heads * config.d_kv
        self.config = config
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]``; ``mask [B, 1, 1, L]`` additive (0 or the dtype's minimum)."""
        b, n, _ = x.shape
        c = self.config
        q, k, v = (proj(x).view(b, n, c.num_heads, c.d_kv).transpose(1, 2) for proj in (self.q, self.k, self.v))
        buckets = relative_buckets(n, c.relative_attention_num_buckets, c.relative_attention_max_distance, x.device)
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None].to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias + mask, scale=1.0)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class SelfAttentionLayer(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.SelfAttention = UMT5Attention(config)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), mask)


class GatedGelu(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x)
        return self.wo(h.to(self.wo.weight.dtype))


class FeedForwardLayer(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.DenseReluDense = GatedGelu(config)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class UMT5Block(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList([SelfAttentionLayer(config), FeedForwardLayer(config)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.layer[0](x, mask)
        if x.dtype == torch.float16:  # as transformers: keep fp16 activations finite
            top = torch.finfo(x.dtype).max
            limit = torch.where(torch.isinf(x).any(), top - 1000, top)
            x = x.clamp(-limit, limit)
        return self.layer[1](x)


class UMT5Stack(nn.Module):
    def __init__(self, config: UMT5Config, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.block = nn.ModuleList(UMT5Block(config) for _ in range(config.num_layers))
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)


class UMT5Encoder(nn.Module):
    """``UMT5EncoderModel``'s parameters and ``last_hidden_state``."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = UMT5Stack(config, self.shared)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``ids``, ``attention_mask [B, L]`` -> hidden states ``[B, L, d_model]``."""
        x = self.shared(ids)
        mask = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(~attention_mask.bool(), torch.finfo(x.dtype).min)[:, None, None, :]
        for block in self.encoder.block:
            x = block(x, mask)
        return self.encoder.final_layer_norm(x)

    def checkpoint_name_map(self, name: str) -> str | None:
        """Checkpoint keys are ours (both names of the tied embedding load it)."""
        return name
