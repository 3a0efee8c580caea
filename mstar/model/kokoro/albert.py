"""PL-BERT, Kokoro's phoneme encoder: an ALBERT encoder (one shared layer applied
``num_hidden_layers`` times) over phoneme ids.

Parameter names are those of ``transformers.AlbertModel``, which the reference subclasses, so
the checkpoint's ``bert.*`` tensors load by name; the pooler (unused: Kokoro reads the last
hidden states) is dropped at load. Padding is a key mask: a padded position is never attended
to, so each row's real positions equal its solo encoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.kokoro.config import PLBertConfig

__all__ = ["PLBert"]


class _Embeddings(nn.Module):
    def __init__(self, c: PLBertConfig, vocab_size: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, c.embedding_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.embedding_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.embedding_size)
        self.LayerNorm = nn.LayerNorm(c.embedding_size, eps=c.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.token_type_embeddings.weight[0] + self.position_embeddings(positions)
        return self.LayerNorm(x)


class _Attention(nn.Module):
    def __init__(self, c: PLBertConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, -1).transpose(1, 2)

        mask = None if keep is None else keep[:, None, None, :]  # [B, 1, 1, T]: True attends
        ctx = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=mask)
        return self.LayerNorm(x + self.dense(ctx.transpose(1, 2).reshape(b, t, -1)))


class _Layer(nn.Module):
    def __init__(self, c: PLBertConfig) -> None:
        super().__init__()
        self.attention = _Attention(c)
        self.ffn = nn.Linear(c.hidden_size, c.intermediate_size)
        self.ffn_output = nn.Linear(c.intermediate_size, c.hidden_size)
        self.full_layer_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.approximate = "tanh" if c.hidden_act == "gelu_new" else "none"

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, keep)
        y = self.ffn_output(F.gelu(self.ffn(x), approximate=self.approximate))
        return self.full_layer_layer_norm(y + x)


class _LayerGroup(nn.Module):
    def __init__(self, c: PLBertConfig) -> None:
        super().__init__()
        self.albert_layers = nn.ModuleList([_Layer(c)])


class _Encoder(nn.Module):
    def __init__(self, c: PLBertConfig) -> None:
        super().__init__()
        self.embedding_hidden_mapping_in = nn.Linear(c.embedding_size, c.hidden_size)
        self.albert_layer_groups = nn.ModuleList([_LayerGroup(c)])


class PLBert(nn.Module):
    """Phoneme ids ``[B, T]`` (and ``keep`` ``[B, T]``, False at padding) -> ``[B, T, hidden]``."""

    def __init__(self, config: PLBertConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config, vocab_size)
        self.encoder = _Encoder(config)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = self.encoder.embedding_hidden_mapping_in(self.embeddings(ids))
        layer = self.encoder.albert_layer_groups[0].albert_layers[0]
        for _ in range(self.config.num_hidden_layers):
            x = layer(x, keep)
        return x
