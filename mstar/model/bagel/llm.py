"""BAGEL's language model: Qwen2 with mixture-of-transformers (MoT) layers over the paged KV.

Every layer holds two sets of weights with the same shapes: the understanding set (the
usual Qwen2 names: ``q_proj`` ..., ``mlp``, ``input_layernorm`` ...) and the generation set
(the same names with ``_moe_gen``). A step's tokens are flattened, as for any decoder, and
a per-token ``generation`` mask says which set each one takes: text and ViT tokens the
understanding weights, VAE latent tokens the generation ones. The attention itself is
shared: every token's keys and values go to the one paged KV cache of its sequence, and
every query attends over all of them. The final norm is per token too (``norm`` /
``norm_moe_gen``); the output head reads understanding tokens only.

BAGEL adds per-head RMS norms on queries and keys (``q_norm`` / ``k_norm``, each with its
``_moe_gen`` twin), applied after the projections and before RoPE.

Rope positions are not cache positions in BAGEL: the tokens of an image (its
``<|vision_start|>``, its patches, its ``<|vision_end|>``) all sit at one rope position and
attend to each other both ways. So the step takes ``rope_positions`` apart from the
attention metadata, whose ``positions`` are mask positions: the last cache index each
query sees (``attention_positions`` makes them; the paged-attention reference masks keys
at cache index ``> positions``).

Parameter names are the released checkpoint's below ``language_model.`` (``model.layers.N.
self_attn.q_proj_moe_gen.weight``, ``lm_head.weight``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.mlp import SwiGLU
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.layers.rotary import RotaryEmbedding, apply_rotary_qk
from mstar.model.bagel.config import BagelLLMConfig

GEN = "_moe_gen"


@dataclass(frozen=True)
class TokenSplit:
    """Which rows of a step take the generation weights. ``gen`` and ``und`` are the row
    indices (``None`` when every row is of the other kind)."""

    und: torch.Tensor | None
    gen: torch.Tensor | None

    @classmethod
    def of(cls, generation: torch.Tensor | None, rows: int, device: torch.device) -> TokenSplit:
        """From a ``[T]`` bool mask (``None``: all understanding)."""
        if generation is None or not bool(generation.any()):
            return cls(und=None, gen=None)
        if bool(generation.all()):
            return cls(und=torch.empty(0, dtype=torch.long, device=device), gen=None)
        gen = generation.nonzero().flatten().to(device)
        und = (~generation).nonzero().flatten().to(device)
        return cls(und=und, gen=gen)

    @property
    def all_und(self) -> bool:
        return self.und is None and self.gen is None

    @property
    def all_gen(self) -> bool:
        return self.gen is None and self.und is not None

    def route(self, x: torch.Tensor, und: Callable[[torch.Tensor], torch.Tensor],
              gen: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``und`` over the understanding rows of ``x``, ``gen`` over the others, in place."""
        if self.all_und:
            return und(x)
        if self.all_gen:
            return gen(x)
        und_out = und(x.index_select(0, self.und))
        out = und_out.new_empty((x.shape[0], *und_out.shape[1:]))
        out.index_copy_(0, self.und, und_out)
        out.index_copy_(0, self.gen, gen(x.index_select(0, self.gen)))
        return out


def attention_positions(start: int, length: int, causal: bool) -> torch.Tensor:
    """Mask positions of ``length`` new tokens written at cache indices ``start ...``: each
    token's own index (causal: text) or, for a block that attends both ways (an image), the
    block's last index for all of them."""
    if causal:
        return torch.arange(start, start + length)
    return torch.full((length,), start + length - 1)


class MoTAttention(nn.Module):
    """Grouped-query attention with per-token expert weights and q/k norms."""

    def __init__(self, config: BagelLLMConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.scale = d ** -0.5
        for suffix in ("", GEN):
            setattr(self, "q_proj" + suffix, nn.Linear(h, self.num_heads * d, bias=True))
            setattr(self, "k_proj" + suffix, nn.Linear(h, self.num_kv_heads * d, bias=True))
            setattr(self, "v_proj" + suffix, nn.Linear(h, self.num_kv_heads * d, bias=True))
            setattr(self, "o_proj" + suffix, nn.Linear(self.num_heads * d, h, bias=False))
            setattr(self, "q_norm" + suffix, RMSNorm(d, config.rms_norm_eps))
            setattr(self, "k_norm" + suffix, RMSNorm(d, config.rms_norm_eps))

    def _qkv(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        rows = x.shape[0]
        q = getattr(self, "q_proj" + suffix)(x).view(rows, self.num_heads, self.head_dim)
        k = getattr(self, "k_proj" + suffix)(x).view(rows, self.num_kv_heads, self.head_dim)
        v = getattr(self, "v_proj" + suffix)(x).view(rows, self.num_kv_heads, self.head_dim)
        q, k = getattr(self, "q_norm" + suffix)(q), getattr(self, "k_norm" + suffix)(k)
        return torch.cat((q, k, v), dim=1)  # [rows, Hq + 2 Hkv, D]

    def forward(self, x: torch.Tensor, split: TokenSplit, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        qkv = split.route(x, lambda rows: self._qkv(rows, ""), lambda rows: self._qkv(rows, GEN))
        q, k, v = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
        q, k = apply_rotary_qk(q, k, cos, sin)
        out = paged_attention(q, k, v.contiguous(), kv_cache, meta, self.scale).flatten(1)
        return split.route(out, self.o_proj, self.o_proj_moe_gen)


class MoTDecoderLayer(nn.Module):
    def __init__(self, config: BagelLLMConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = MoTAttention(config)
        self.mlp = SwiGLU(h, config.intermediate_size)
        self.mlp_moe_gen = SwiGLU(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_moe_gen = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, split: TokenSplit, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        normed = split.route(x, self.input_layernorm, self.input_layernorm_moe_gen)
        x = x + self.self_attn(normed, split, cos, sin, kv_cache, meta)
        mlp_out = split.route(x, lambda r: self.mlp(self.post_attention_layernorm(r)),
                              lambda r: self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(r)))
        return x + mlp_out


class MoTModel(nn.Module):
    """``language_model.model``: embeddings, the MoT layers and the two final norms."""

    def __init__(self, config: BagelLLMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoTDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)


class BagelLanguageModel(nn.Module):
    """``language_model``: the MoT decoder and its output head.

    ``forward`` runs one step: ``embeds [T, hidden]`` (token embeddings, or the ViT / VAE
    tokens spliced in by the caller), ``rope_positions [T]``, the per-layer paged caches, the
    step's metadata (``positions`` = mask positions, see the module docstring) and the
    optional ``generation [T]`` bool mask. Returns the final-normed hidden states ``[T, H]``.
    """

    def __init__(self, config: BagelLLMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MoTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def forward(self, embeds: torch.Tensor, rope_positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: PagedAttentionMetadata, generation: torch.Tensor | None = None) -> torch.Tensor:
        split = TokenSplit.of(generation, embeds.shape[0], embeds.device)
        cos, sin = self.model.rotary.cos_sin(rope_positions.to(embeds.device), embeds.dtype)
        x = embeds
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, split, cos, sin, kv_cache, meta)
        return split.route(x, self.model.norm, self.model.norm_moe_gen)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache."""
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim
