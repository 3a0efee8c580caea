"""The OmniVoice canvas network: a Qwen3 stack with full attention over a canvas of codebook rows.

A canvas is ``[B, C, L]`` ids: ``C`` codebook rows over ``L`` positions. Text positions (the
style and text prompt) carry the same token id in every row and are embedded by the LLM's own
table from row 0; audio positions (reference audio, then the target, whose ids start as the mask
id) embed each row's id in its own slice of ``audio_embeddings`` (row ``c`` id ``v`` at
``c * audio_vocab_size + v``) and sum the rows. The stack runs with the caller's ``[B, 1, L, L]``
boolean mask (True = attend; no causal part: every position sees every visible one), positions
``0..L-1`` in each row, and the final RMSNorm; ``audio_heads`` then scores all ``C`` rows at
once, ``[B, C, L, audio_vocab_size]``.

Parameter names are the release's (``llm.embed_tokens``, ``llm.layers.{i}...``, ``llm.norm``,
``audio_embeddings``, ``audio_heads``); the layer maths is ``mstar.model.qwen3.encoder``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.model.omnivoice.config import OmniVoiceConfig
from mstar.model.qwen3.encoder import Qwen3Stack


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
