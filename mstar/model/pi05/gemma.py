"""The two Gemmas of Pi0.5 over one paged KV cache: PaliGemma's language model (the prefix)
and the action expert (the suffix, whose norms are conditioned on the flow time).

Both take a step's tokens flattened ``[T, hidden]`` with explicit rotary ``positions [T]``, the
per-layer paged caches and a ``PagedAttentionMetadata`` (``mstar.layers.paged_kv``). Pi0.5's
attention is not causal: the prefix (images and prompt) sees all of itself, and the action
chunk sees the whole prefix and all of itself, never the other way. Both are "every new token
sees every key its sequence has", so the metadata handed to the attention is
``sees_whole_sequence(meta)``: each token's mask position is its sequence's last, while the
rotary positions stay the real ones. The expert writes the chunk's keys and values after the
prefix in the cache and overwrites them on the next step, so a denoise step reads only the
prefix and itself.

Parameter names follow the released checkpoint: ``language_model.{embed_tokens, layers.N, norm}``
and ``gemma_expert.model.{layers.N, norm}``; an adaptive norm is ``<norm>.dense``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata, write_kv_cache
from mstar.layers.rotary import RotaryEmbedding
from mstar.model.pi05.config import GemmaDims


def sees_whole_sequence(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    """``meta`` with every new token placed, for the mask, at its sequence's last position (so
    it attends to all of its sequence's keys, those written this step included)."""
    starts, lengths = meta.query_starts, meta.seq_lens_list
    last = [lengths[b] - 1 for b in range(len(lengths)) for _ in range(starts[b + 1] - starts[b])]
    positions = torch.tensor(last, dtype=torch.int64, device=meta.positions.device)
    return dataclasses.replace(meta, positions=positions)


@dataclasses.dataclass(frozen=True)
class ChunkKeys:
    """A step's attention as padded tensors, every new token seeing all of its sequence's keys
    (both of Pi0.5's phases): the ``T`` new tokens at ``positions [T]`` are written to
    ``write_slots [T]`` of the flat cache; ``key_slots [B, L]`` are the flat slots of each
    sequence's positions ``0 .. L-1`` and ``visible [B, L]`` says which exist (the rest are
    padding to a common length, masked out, pointing at a real slot so that what they read is
    finite). The queries are ``B`` rows of ``n``: as they come (``T = B * n``: a denoise step,
    fixed shapes a CUDA graph can replay), or, given ``query_rows [B, n]`` (the index of each
    row's ``j``-th token among the ``T``; ``T`` for padding) and ``query_order [T]`` (each
    token's place in the ``B * n`` grid), gathered into rows (a prefill of unequal prompts)."""

    positions: torch.Tensor
    write_slots: torch.Tensor
    key_slots: torch.Tensor
    visible: torch.Tensor
    query_rows: torch.Tensor | None = None
    query_order: torch.Tensor | None = None


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, keys: ChunkKeys,
                    scale: float) -> torch.Tensor:
    """``paged_attention``'s contract for ``ChunkKeys``: the new K/V written to the cache, then
    one attention over every sequence's padded keys at once (``[T, Hq, D]`` out) instead of one
    per sequence."""
    write_kv_cache(k, v, kv_cache, keys.write_slots)
    rows, length = keys.key_slots.shape
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k.shape[1]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    slots = keys.key_slots.reshape(-1)

    def gather(which: int) -> torch.Tensor:  # [B, Hkv, L, D]
        return flat[which].index_select(0, slots).view(rows, length, num_kv_heads, head_dim).transpose(1, 2)

    query = q if keys.query_rows is None else torch.cat([q, q.new_zeros(1, num_heads, head_dim)]).index_select(
        0, keys.query_rows.reshape(-1))
    out = F.scaled_dot_product_attention(query.view(rows, -1, num_heads, head_dim).transpose(1, 2),  # [B, Hq, n, D]
                                         gather(0).to(q.dtype), gather(1).to(q.dtype),
                                         attn_mask=keys.visible[:, None, None, :], scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
    return out if keys.query_order is None else out.index_select(0, keys.query_order)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMS norm: scale ``1 + weight``, all in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class AdaptiveRMSNorm(nn.Module):
    """RMS norm without a weight, whose scale, shift and residual gate are a linear function of
    the flow time's embedding: ``cond [B, hidden]``, one row per sequence, each sequence owning
    an equal share of the ``T`` tokens (a denoise step's sequences all have one chunk)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, 3 * hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        modulation = self.dense(cond).repeat_interleave(x.shape[0] // cond.shape[0], dim=0)
        scale, shift, gate = modulation.chunk(3, dim=-1)
        return (x32 * (1.0 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, dims: GemmaDims) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.q_proj = nn.Linear(dims.hidden_size, dims.num_heads * dims.head_dim, bias=False)
        self.k_proj = nn.Linear(dims.hidden_size, dims.num_kv_heads * dims.head_dim, bias=False)
        self.v_proj = nn.Linear(dims.hidden_size, dims.num_kv_heads * dims.head_dim, bias=False)
        self.o_proj = nn.Linear(dims.num_heads * dims.head_dim, dims.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(dims.head_dim, dims.rope_theta)
        self.scale = dims.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: PagedAttentionMetadata | ChunkKeys) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        if isinstance(meta, ChunkKeys):
            out = chunk_attention(q, k, v, kv_cache, meta, self.scale)
        else:
            out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, -1))


class GemmaMLP(nn.Module):
    def __init__(self, dims: GemmaDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, dims: GemmaDims) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = GemmaAttention(dims)
        self.post_attention_layernorm = GemmaRMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = GemmaMLP(dims)

    def forward(self, x, positions, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class ExpertDecoderLayer(nn.Module):
    """A Gemma layer whose two norms are adaptive and whose residual branches are gated."""

    def __init__(self, dims: GemmaDims) -> None:
        super().__init__()
        self.input_layernorm = AdaptiveRMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = GemmaAttention(dims)
        self.post_attention_layernorm = AdaptiveRMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = GemmaMLP(dims)

    def forward(self, x, cond, positions, kv_cache, meta):
        normed, gate = self.input_layernorm(x, cond)
        x = x + gate * self.self_attn(normed, positions, kv_cache, meta)
        normed, gate = self.post_attention_layernorm(x, cond)
        return x + gate * self.mlp(normed)


class GemmaLanguageModel(nn.Module):
    """PaliGemma's Gemma: embeds prompt tokens (scaled by ``sqrt(hidden)``), runs the prefix
    into the cache, and gives logits with the tied embedding."""

    def __init__(self, dims: GemmaDims, vocab_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(dims) for _ in range(dims.num_layers))
        self.norm = GemmaRMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.embed_scale = dims.hidden_size**0.5

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight
        return self.embed_tokens(token_ids) * torch.tensor(self.embed_scale, dtype=weight.dtype)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: PagedAttentionMetadata | ChunkKeys) -> torch.Tensor:
        """The prefix's final hidden states ``[T, hidden]`` (after the last norm); its keys and
        values are left in ``kv_caches``. ``meta``: the paged metadata, or the same step as
        ``ChunkKeys``."""
        if isinstance(meta, PagedAttentionMetadata):
            meta = sees_whole_sequence(meta)
        x = embeds
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, cache, meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.embed_tokens.weight.t()


class ExpertModel(nn.Module):
    def __init__(self, dims: GemmaDims) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ExpertDecoderLayer(dims) for _ in range(dims.num_layers))
        self.norm = AdaptiveRMSNorm(dims.hidden_size, dims.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, cond: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: PagedAttentionMetadata | ChunkKeys) -> torch.Tensor:
        """The chunks' final hidden states ``[T, hidden]``; ``cond [B, hidden]`` is each
        sequence's time embedding (its tokens are ``T / B`` consecutive rows). ``meta``: the
        paged metadata, or the same step as ``ChunkKeys``."""
        if isinstance(meta, PagedAttentionMetadata):
            meta = sees_whole_sequence(meta)
        x = embeds
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cond, positions, cache, meta)
        return self.norm(x, cond)[0]


class GemmaExpert(nn.Module):
    """``gemma_expert``: the model under ``.model`` (the checkpoint's unused ``lm_head`` is
    skipped at load)."""

    def __init__(self, dims: GemmaDims) -> None:
        super().__init__()
        self.model = ExpertModel(dims)
