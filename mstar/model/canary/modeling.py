"""Canary: the FastConformer encoder and a Transformer decoder over a paged KV cache.

The decoder embeds tokens, adds fixed sinusoidal positions (sines then cosines, timescales up
to ``10000 ** ((C - 2) / C)``, divided by ``sqrt(C)``) and normalises the sum; each pre-norm
block runs causal self-attention over the paged cache, cross-attention to its clip's encoder
frames, and a two-layer MLP; a final norm, then the output projection (tied to the token
embedding, with a bias of its own).

A step's new tokens are flattened across sequences (``PagedAttentionMetadata``); each
sequence cross-attends to its own clip, whose keys and values are projected once, per layer,
when its first step runs (``cross_kv``) and kept by the engine. ``CrossBatch`` gathers them for
a step: padded to the step's longest clip, with a mask of each clip's frames.

Parameter names are those of transformers' ``CanaryForConditionalGeneration``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.canary.config import CanaryConfig, CanaryDecoderConfig
from mstar.model.fastconformer.encoder import FastConformerEncoder, activation

CrossKV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values [frames, kv_heads, head_dim]


@dataclass(frozen=True)
class CrossBatch:
    """The clips a step's tokens cross-attend to: per layer, keys and values
    ``[B, frames, kv_heads, head_dim]`` of its ``B`` sequences (padded to the longest clip),
    ``frames`` ``[B, frames]`` (True on a clip's own frames), and ``token_seq`` ``[T]`` (the
    sequence of each new token)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    frames: torch.Tensor
    token_seq: torch.Tensor

    @classmethod
    def build(cls, clips: list[list[CrossKV]], counts: list[int]) -> CrossBatch:
        """From each sequence's per-layer ``(keys, values)`` and its number of new tokens."""
        device = clips[0][0][0].device
        lengths = torch.tensor([clip[0][0].shape[0] for clip in clips], device=device)
        width = int(lengths.max())
        keys, values = [], []
        for layer in range(len(clips[0])):
            keys.append(nn.utils.rnn.pad_sequence([clip[layer][0] for clip in clips], batch_first=True))
            values.append(nn.utils.rnn.pad_sequence([clip[layer][1] for clip in clips], batch_first=True))
        frames = torch.arange(width, device=device)[None, :] < lengths[:, None]
        token_seq = torch.repeat_interleave(torch.arange(len(clips), device=device),
                                            torch.tensor(counts, device=device))
        return cls(keys, values, frames, token_seq)


def sinusoidal_positions(length: int, channels: int) -> torch.Tensor:
    """``[length, channels]``: sines of every timescale, then cosines (not yet scaled)."""
    increment = math.log(10000 ** ((channels - 2) / channels)) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())
    angles = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class Attention(nn.Module):
    def __init__(self, config: CanaryDecoderConfig) -> None:
        super().__init__()
        width, bias = config.hidden_size, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, width, bias=bias)
        self.scale = self.head_dim ** -0.5

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))

    def key_value(self, x: torch.Tensor) -> CrossKV:
        return (self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)),
                self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended.flatten(-2))


def cross_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: CrossBatch,
                    scale: float) -> torch.Tensor:
    """Queries ``[T, H, D]`` attend to their sequences' clips (``keys``/``values`` of one layer,
    ``[B, frames, Hkv, D]``), padded frames masked; returns ``[T, H, D]``."""
    groups = q.shape[1] // keys.shape[2]
    k = keys.index_select(0, batch.token_seq).repeat_interleave(groups, dim=2)  # [T, F, H, D]
    v = values.index_select(0, batch.token_seq).repeat_interleave(groups, dim=2)
    scores = torch.einsum("thd,tfhd->thf", q, k) * scale
    valid = batch.frames.index_select(0, batch.token_seq)[:, None, :]
    scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.einsum("thf,tfhd->thd", weights, v)


class DecoderMLP(nn.Module):
    def __init__(self, config: CanaryDecoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: CanaryDecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.encoder_attn = Attention(config)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.final_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, kv_cache: torch.Tensor, cross_keys: torch.Tensor,
                cross_values: torch.Tensor, cross: CrossBatch) -> torch.Tensor:
        attn = self.self_attn
        h = self.input_layernorm(x)
        k, v = attn.key_value(h)
        x = x + attn.output(paged_attention(attn.query(h), k, v, kv_cache, meta, scale=attn.scale))
        q = self.encoder_attn.query(self.post_attention_layernorm(x))
        x = x + self.encoder_attn.output(cross_attention(q, cross_keys, cross_values, cross, self.encoder_attn.scale))
        return x + self.mlp(self.final_layernorm(x))


class CanaryDecoder(nn.Module):
    def __init__(self, config: CanaryDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.embedding_layernorm = nn.LayerNorm(config.hidden_size)
        # float32, then the model's dtype: what building in float32 and casting gave
        table = sinusoidal_positions(config.max_position_embeddings, config.hidden_size)
        self.register_buffer("positions", table.to(torch.get_default_dtype()), persistent=False)

    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                cross: CrossBatch) -> torch.Tensor:
        positions = self.positions[meta.positions] / math.sqrt(self.config.hidden_size)
        x = self.embedding_layernorm(self.embed_tokens(input_ids) + positions.to(self.embed_tokens.weight.dtype))
        for layer, kv_cache, keys, values in zip(self.layers, kv_caches, cross.keys, cross.values, strict=True):
            x = layer(x, meta, kv_cache, keys, values, cross)
        return self.norm(x)


class CanaryModel(nn.Module):
    def __init__(self, config: CanaryConfig) -> None:
        super().__init__()
        self.encoder = FastConformerEncoder(config.encoder)
        self.decoder = CanaryDecoder(config.decoder)


class CanaryForConditionalGeneration(nn.Module):
    def __init__(self, config: CanaryConfig) -> None:
        super().__init__()
        self.config = config
        self.model = CanaryModel(config)
        self.proj_out = nn.Linear(config.decoder.hidden_size, config.decoder.vocab_size)
        if config.tie_word_embeddings:
            self.proj_out.weight = self.model.decoder.embed_tokens.weight

    def encode(self, mel: torch.Tensor, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder frames ``[B, T', hidden]`` and their counts of log-mels ``[B, T, mel]``."""
        return self.model.encoder(mel, lengths)

    def cross_kv(self, frames: torch.Tensor) -> list[CrossKV]:
        """Per decoder layer, the cross-attention keys and values of ONE clip's frames ``[F, hidden]``."""
        return [layer.encoder_attn.key_value(frames) for layer in self.model.decoder.layers]

    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                cross: CrossBatch) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of a step's new tokens."""
        return self.model.decoder(input_ids, meta, kv_caches, cross)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden)

    def kv_layout(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)`` of the paged self-attention caches."""
        decoder = self.config.decoder
        return decoder.num_hidden_layers, decoder.num_key_value_heads, decoder.head_dim


__all__ = ["CanaryForConditionalGeneration", "CrossBatch", "cross_attention", "sinusoidal_positions"]
