"""The OmniVoice canvas network: a Qwen3 stack with full attention over a canvas of codebook rows.

A canvas is ``[B, C, L]`` ids: ``C`` codebook rows over ``L`` positions. Text positions (the
style and text prompt) carry the same token id in every row and are embedded by the LLM's own
table from row 0; audio positions (reference audio, then the target, whose ids start as the mask
id) embed each row's id in its own slice of ``audio_embeddings`` (row ``c`` id ``v`` at
``c * audio_vocab_size + v``) and sum the rows. The stack runs with the caller's ``[B, 1, L, L]``
boolean mask (True = attend; no causal part: every position sees every visible one), positions
``0..L-1`` in each row, and the final RMSNorm; ``audio_heads`` then scores all ``C`` rows at
once, ``[B, C, L, audio_vocab_size]``.

``forward_packed`` runs the same maths on rows of different lengths without padding: the
rows' positions are concatenated for every dense part and attention runs row by row over the
row's own positions, so a row's logits are the same whatever it is batched with (a padded batch
changes attention's reduction lengths, and with them the last bits).

Parameter names are the release's (``llm.embed_tokens``, ``llm.layers.{i}...``, ``llm.norm``,
``audio_embeddings``, ``audio_heads``); the layer maths is ``mstar.model.qwen3.encoder``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.rotary import apply_rotary
from mstar.model.omnivoice.config import OmniVoiceConfig
from mstar.model.qwen3.encoder import Qwen3Attention, Qwen3Stack


class OmniVoiceBackbone(nn.Module):
    """Embeds a canvas, runs the bidirectional Qwen3 stack and scores every codebook row."""

    def __init__(self, config: OmniVoiceConfig) -> None:
        super().__init__()
        self.config = config
        rows, vocab = config.num_audio_codebook, config.audio_vocab_size
        self.llm = Qwen3Stack(config.llm, config.llm.num_hidden_layers, with_norm=True)
        self.audio_embeddings = nn.Embedding(rows * vocab, config.llm.hidden_size)
        self.audio_heads = nn.Linear(config.llm.hidden_size, rows * vocab, bias=False)
        self.register_buffer("codebook_layer_offsets", torch.arange(rows) * vocab,
                             persistent=False)

    def embed(self, input_ids: torch.Tensor, audio_mask: torch.Tensor) -> torch.Tensor:
        """``[B, C, L]`` ids and ``[B, L]`` audio flags -> ``[B, L, hidden]``."""
        text = self.llm.embed_tokens(input_ids[:, 0])
        # Text positions look up row offsets only (id 0 of each row); their sum is discarded.
        audio_ids = input_ids * audio_mask[:, None] + self.codebook_layer_offsets[None, :, None]
        audio = self.audio_embeddings(audio_ids).sum(dim=1)
        return torch.where(audio_mask[..., None], audio, text)

    def forward(self, input_ids: torch.Tensor, audio_mask: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C, L, audio_vocab_size]`` (float32 whatever the weights' dtype)."""
        x = self.embed(input_ids, audio_mask)
        batch, length, _ = x.shape
        positions = torch.arange(length, device=x.device)
        cos_sin = self.llm.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.llm.layers:
            x = layer(x, cos_sin, attention_mask)
        assert self.llm.norm is not None
        logits = self.audio_heads(self.llm.norm(x)).float()
        rows, vocab = self.config.num_audio_codebook, self.config.audio_vocab_size
        return logits.view(batch, length, rows, vocab).transpose(1, 2)

    def forward_packed(self, rows: list[torch.Tensor], audio_masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Logits ``[C, L_i, audio_vocab_size]`` for each row ``[C, L_i]`` (every position of a
        row sees every other; no padding anywhere)."""
        lengths = [r.shape[-1] for r in rows]
        x = torch.cat([self.embed(r[None], m[None])[0] for r, m in zip(rows, audio_masks)])
        positions = torch.cat([torch.arange(n, device=x.device) for n in lengths])
        cos_sin = self.llm.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.llm.layers:
            x = x + _packed_attention(layer.self_attn, layer.input_layernorm(x), cos_sin, lengths)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        assert self.llm.norm is not None
        logits = self.audio_heads(self.llm.norm(x)).float()
        rows_, vocab = self.config.num_audio_codebook, self.config.audio_vocab_size
        return [part.view(n, rows_, vocab).transpose(0, 1) for part, n in zip(logits.split(lengths), lengths)]


def _packed_attention(attn: Qwen3Attention, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                      lengths: list[int]) -> torch.Tensor:
    """``attn`` over packed positions ``x [N, hidden]``, each row of ``lengths`` on its own."""
    total = x.shape[0]
    q = attn.q_norm(attn.q_proj(x).view(total, -1, attn.head_dim))
    k = attn.k_norm(attn.k_proj(x).view(total, -1, attn.head_dim))
    v = attn.v_proj(x).view(total, -1, attn.head_dim)
    cos, sin = cos_sin
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    outs = []
    for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (qi, ki, vi))  # [1, heads, L, D]
        out = F.scaled_dot_product_attention(qi, ki, vi, scale=attn.scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1).reshape(qi.shape[2], -1))
    return attn.o_proj(torch.cat(outs))
