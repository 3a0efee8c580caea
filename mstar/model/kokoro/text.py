"""Kokoro's text encoder: phoneme embeddings, ``n_layer`` convolution blocks (conv, layer norm
over channels, leaky ReLU 0.2) and a bidirectional LSTM; padded positions are zero after every
stage. Ids ``[B, T]`` -> features ``[B, hidden_dim, T]`` (the decoder's phonetic input)."""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.norm import ChannelLayerNorm
from mstar.model.kokoro.blocks import run_lstm

__all__ = ["TextEncoder"]


class TextEncoder(nn.Module):
    def __init__(self, channels: int, kernel_size: int, depth: int, n_symbols: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(n_symbols, channels)
        self.cnn = nn.ModuleList(
            nn.Sequential(
                nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2),
                ChannelLayerNorm(channels),
                nn.LeakyReLU(0.2),
            )
            for _ in range(depth)
        )
        self.lstm = nn.LSTM(channels, channels // 2, 1, batch_first=True, bidirectional=True)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """``pad`` ``[B, T]`` is True at padding."""
        x = self.embedding(ids).transpose(1, 2).masked_fill(pad[:, None], 0.0)
        for block in self.cnn:
            x = block(x).masked_fill(pad[:, None], 0.0)
        x = run_lstm(self.lstm, x.transpose(1, 2), lengths).transpose(1, 2)
        return x.masked_fill(pad[:, None], 0.0)
