"""GPT-2 decoder on the paged KV cache: Chatterbox Turbo's T3 backbone.

Parameter names are Hugging Face ``GPT2Model``'s (``wpe``, ``h.{i}.ln_1``, ``attn.c_attn``,
...), and the projections keep GPT-2's ``Conv1D`` layout (weight ``[in, out]``), so the
released tensors load by name without a transpose. There is no token table: T3 feeds its own
embeddings, and ``wte`` of the released file is dropped at load (the reference deletes it too).
The learned absolute positions ``wpe`` are added here, at each token's absolute position in
its sequence, as ``GPT2Model`` does from its cache position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.chatterbox.config import GPT2Config


class Conv1D(nn.Module):
    """GPT-2's linear layer: ``x @ weight + bias`` with ``weight [in, out]`` (the transpose of
    ``nn.Linear``'s), computed as one ``addmm`` like the reference's."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.c_attn = Conv1D(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = (t.view(tokens, self.heads, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))
        out = paged_attention(q, k, v, kv_cache, meta, self.head_dim**-0.5)
        return self.c_proj(out.reshape(tokens, -1))


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.hidden_size, 4 * config.hidden_size)
        self.c_proj = Conv1D(4 * config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's "gelu_new"


class GPT2Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta, kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Positions, blocks and the final norm over flattened step tokens ``[T, hidden]``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        if len(kv_caches) != len(self.h):
            raise ValueError(f"expected {len(self.h)} KV caches, got {len(kv_caches)}")
        x = inputs_embeds + self.wpe(meta.positions.to(inputs_embeds.device))
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, meta, kv_cache)
        return self.ln_f(x)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache."""
        return len(self.h), self.config.num_attention_heads, self.config.head_dim
