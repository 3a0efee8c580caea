"""The Qwen3.5 hybrid language model on a paged KV cache and recurrent-state slots.

Layers are gated DeltaNet (``linear_attention``: state in slots, see
``mstar.layers.gated_deltanet``) or gated full attention (``full_attention``: paged KV,
MRoPE on part of each head, output gated by ``sigmoid`` of a second query half). Parameter
names are those of transformers' ``Qwen3_5ForCausalLM`` (``model.layers.*``); the
multimodal checkpoint's ``model.language_model.*`` keys map onto them
(``mstar.model.qwen3_5.checkpoint``).

Tensor parallelism lives in the layers (``mstar.layers.linear``): built under a parallel
state (``mstar.distributed.use_parallel``), a rank holds its share of the attention heads,
the DeltaNet heads (``mstar.layers.gated_deltanet``), the MLP features and the vocabulary,
and its KV cache and state slots hold only its heads (``cache_shape``, ``state_shapes``).
Built outside one, every layer is its plain ``torch.nn`` counterpart.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.gated_deltanet import GatedDeltaNet, StateBatch
from mstar.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from mstar.layers.mlp import SwiGLU
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.layers.rotary import MRotaryEmbedding, apply_rotary
from mstar.model.qwen3_5.config import FULL, Qwen3_5Config


class ZeroCenteredRMSNorm(nn.Module):
    """RMS norm whose learned scale is ``1 + weight`` (weight starts at zero); float32 maths."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Qwen3_5Attention(nn.Module):
    """Grouped-query attention with per-head q/k norms, partial MRoPE and a sigmoid output
    gate (``q_proj`` yields, per head, the query then its gate).

    Under tensor parallelism a rank holds whole heads (each query with its gate) and whole
    KV heads, caches only those, and ``o_proj`` sums the ranks' partial outputs;
    ``num_heads``/``num_kv_heads`` are this rank's."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.head_dim = d
        self.scale = d**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        # A block of 2 * head_dim keeps each head's query with its gate on one rank.
        self.q_proj = ColumnParallelLinear(hidden, heads * d * 2, bias=bias, block=2 * d)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * d, bias=bias, block=d)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * d, bias=bias, block=d)
        self.o_proj = RowParallelLinear(heads * d, hidden, bias=bias, block=d)
        self.num_heads = self.q_proj.out_features // (2 * d)  # on this rank
        self.num_kv_heads = self.k_proj.out_features // d
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                meta: PagedAttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, gate = self.q_proj(x).view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale).reshape(tokens, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is
    ``linear_attn`` (gated DeltaNet) or ``self_attn`` as the layer type says."""

    def __init__(self, config: Qwen3_5Config, layer_type: str) -> None:
        super().__init__()
        self.is_full_attention = layer_type == FULL
        if self.is_full_attention:
            self.self_attn = Qwen3_5Attention(config)
        else:
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: PagedAttentionMetadata,
                states: StateBatch, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``cache`` is the layer's KV cache, or its (conv window, recurrent state) tensors."""
        h = self.input_layernorm(x)
        if self.is_full_attention:
            x = x + self.self_attn(h, cos_sin, meta, *cache)
        else:
            x = x + self.linear_attn(h, states, *cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridCaches:
    """A step's view of the per-layer caches: one paged KV tensor per full-attention layer,
    a conv window and a recurrent state tensor (``[slots, ...]``) per DeltaNet layer."""

    def __init__(self, kv: list[torch.Tensor], conv: list[torch.Tensor], recurrent: list[torch.Tensor]) -> None:
        if len(conv) != len(recurrent):
            raise ValueError(f"{len(conv)} conv states but {len(recurrent)} recurrent states")
        self.kv, self.conv, self.recurrent = kv, conv, recurrent


class Qwen3_5TextModel(nn.Module):
    """Embeddings, the hybrid layers and the final norm (the ``model.`` prefix)."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, t) for t in config.layer_types)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MRotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, states: StateBatch,
                caches: HybridCaches, positions: torch.Tensor | None = None) -> torch.Tensor:
        num_full = len(self.config.full_layers)
        if len(caches.kv) != num_full or len(caches.conv) != len(self.layers) - num_full:
            raise ValueError(f"expected {num_full} KV caches and {len(self.layers) - num_full} state caches, "
                             f"got {len(caches.kv)} and {len(caches.conv)}")
        cos_sin = self.rotary.cos_sin(meta.positions if positions is None else positions, x.dtype)
        kv, recurrent = iter(caches.kv), iter(zip(caches.conv, caches.recurrent))
        for layer in self.layers:
            x = layer(x, cos_sin, meta, states, (next(kv),) if layer.is_full_attention else next(recurrent))
        return self.norm(x)


class Qwen3_5ForCausalLM(nn.Module):
    """The text model with its head, one paged step per ``forward``."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3_5TextModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata, states: StateBatch,
                caches: HybridCaches, inputs_embeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's ``T`` new tokens.

        ``positions`` (``[3, T]`` MRoPE positions) defaults to ``meta.positions`` on all
        three axes (text); ``inputs_embeds`` replaces the embedding lookup when given.
        """
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(x, meta, states, caches, positions)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection's weight (this rank's vocabulary rows under TP)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` (the whole vocabulary, on every rank) of ``hidden [N, hidden]``."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.logits(hidden)
        return self.lm_head(hidden)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(full-attention layers, KV heads, head_dim)`` of the paged KV cache this module
        fills: a tensor-parallel rank caches the KV heads it holds."""
        attn = [layer.self_attn for layer in self.model.layers if layer.is_full_attention]
        if not attn:
            return 0, self.config.num_key_value_heads, self.config.head_dim
        return len(attn), attn[0].num_kv_heads, attn[0].head_dim

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot shapes of one DeltaNet layer's states (all layers are alike)."""
        linear = self.config.linear_layers
        return self.model.layers[linear[0]].linear_attn.state_shapes() if linear else {}
