"""VITS text encoder: phoneme embeddings through a transformer whose self-attention adds
learned relative-position terms inside a window of +-``window_size`` phonemes.

Channels-first tensors ``[B, C, T]`` with a ``[B, 1, T]`` length mask throughout, as the
exported graph computes them: padded positions are zeroed after every block and masked out of
the attention, so a padded row computes what it would alone.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from mstar.layers.norm import ChannelLayerNorm
from mstar.model.piper.config import PiperArch

__all__ = ["Encoder", "RelativeSelfAttention", "TextEncoder", "sequence_mask"]


def sequence_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, max_len]`` bool: position ``t`` of row ``b`` is inside ``lengths[b]``."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]



class RelativeSelfAttention(nn.Module):
    """Multi-head self-attention with windowed relative-position keys and values shared by
    the heads (``emb_rel_k``/``emb_rel_v``: ``[1, 2w+1, d_head]``, offset ``-w..w``).

    Offsets beyond the window contribute nothing, which is what the reference's padded
    relative tables amount to; we gather the ``2w+1`` band directly instead of building the
    ``2T-1`` table and skewing it.
    """

    def __init__(self, channels: int, n_heads: int, window_size: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.d_head = channels // n_heads
        self.window = window_size
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)
        span = 2 * window_size + 1
        self.emb_rel_k = nn.Parameter(torch.zeros(1, span, self.d_head))
        self.emb_rel_v = nn.Parameter(torch.zeros(1, span, self.d_head))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, _, t = x.shape
        return x.view(b, self.n_heads, self.d_head, t).transpose(2, 3)

    def _band(self, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Index ``[T, T]`` of key offset ``j - i`` into the window table, and its validity."""
        pos = torch.arange(t, device=device)
        offset = pos[None, :] - pos[:, None]
        valid = offset.abs() <= self.window
        return (offset + self.window).clamp(0, 2 * self.window), valid

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, C, T]``; ``attn_mask``: ``[B, 1, T, T]`` (1 where both ends are real)."""
        b, c, t = x.shape
        q = self._heads(self.conv_q(x)) / math.sqrt(self.d_head)
        k = self._heads(self.conv_k(x))
        v = self._heads(self.conv_v(x))
        index, valid = self._band(t, x.device)
        scores = q @ k.transpose(-2, -1)
        rel_logits = q @ self.emb_rel_k[0].transpose(0, 1)  # [B, H, T, 2w+1]
        local = torch.gather(rel_logits, -1, index.expand(b, self.n_heads, t, t))
        scores = scores + local * valid
        scores = scores.masked_fill(attn_mask == 0, -1e4)
        p = torch.softmax(scores, dim=-1)
        out = p @ v
        # Attention mass per window offset: scatter each row's band into 2w+1 slots.
        banded = torch.zeros(b, self.n_heads, t, 2 * self.window + 1, dtype=p.dtype, device=p.device)
        banded.scatter_add_(-1, index.expand(b, self.n_heads, t, t), p * valid)
        out = out + banded @ self.emb_rel_v[0]
        out = out.transpose(2, 3).reshape(b, c, t)
        return self.conv_o(out)


class FeedForward(nn.Module):
    """Two same-padded convolutions with a ReLU, masked before each."""

    def __init__(self, channels: int, filter_channels: int, kernel_size: int) -> None:
        super().__init__()
        self.pad = ((kernel_size - 1) // 2, kernel_size // 2)
        self.conv_1 = nn.Conv1d(channels, filter_channels, kernel_size)
        self.conv_2 = nn.Conv1d(filter_channels, channels, kernel_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, C, T]``; ``mask``: ``[B, 1, T]``."""
        x = torch.relu(self.conv_1(F.pad(x * mask, self.pad)))
        return self.conv_2(F.pad(x * mask, self.pad)) * mask


class Encoder(nn.Module):
    """Post-norm transformer stack: relative self-attention then a convolutional FFN."""

    def __init__(self, arch: PiperArch) -> None:
        super().__init__()
        self.attn_layers = nn.ModuleList(
            RelativeSelfAttention(arch.hidden, arch.n_heads, arch.window_size) for _ in range(arch.n_layers))
        self.norm_layers_1 = nn.ModuleList(ChannelLayerNorm(arch.hidden) for _ in range(arch.n_layers))
        self.ffn_layers = nn.ModuleList(
            FeedForward(arch.hidden, arch.filter_channels, arch.kernel_size) for _ in range(arch.n_layers))
        self.norm_layers_2 = nn.ModuleList(ChannelLayerNorm(arch.hidden) for _ in range(arch.n_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, C, T]``; ``mask``: ``[B, 1, T]``."""
        attn_mask = mask.unsqueeze(2) * mask.unsqueeze(-1)
        x = x * mask
        for attn, norm_1, ffn, norm_2 in zip(self.attn_layers, self.norm_layers_1, self.ffn_layers,
                                             self.norm_layers_2, strict=True):
            x = norm_1(x + attn(x, attn_mask))
            x = norm_2(x + ffn(x, mask))
        return x * mask


class TextEncoder(nn.Module):
    """``enc_p``: phoneme ids to the prior's mean and log-std per phoneme, plus the hidden
    states the duration predictor reads."""

    def __init__(self, arch: PiperArch) -> None:
        super().__init__()
        self.hidden = arch.hidden
        self.emb = nn.Embedding(arch.n_vocab, arch.hidden)
        self.encoder = Encoder(arch)
        self.proj = nn.Conv1d(arch.hidden, 2 * arch.inter_channels, 1)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Returns ``(hidden, mean, log_std, mask)``, channels-first, masked."""
        x = (self.emb(ids) * math.sqrt(self.hidden)).transpose(1, 2)
        mask = sequence_mask(lengths, ids.shape[1]).unsqueeze(1).to(x.dtype)
        x = self.encoder(x, mask)
        mean, log_std = (self.proj(x) * mask).chunk(2, dim=1)
        return x, mean, log_std, mask
