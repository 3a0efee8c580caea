"""Kokoro's prosody predictor (StyleTTS2's): from PL-BERT features and the prosody half of the
voice vector, a duration per phoneme, then F0 and energy (``N``) curves at twice the frame rate.

- ``text_encoder`` (a ``DurationEncoder``): ``n_layer`` pairs of a bidirectional LSTM and a
  style-modulated layer norm, the style concatenated to the features before each;
- ``lstm`` + ``duration_proj``: per phoneme, ``max_dur`` logits whose sigmoids summed (divided
  by the speed) are its duration in frames;
- ``shared`` LSTM over the per-frame features, then ``F0`` / ``N``: three ``AdainResBlk1d``
  each (the second doubles the frame rate) and a 1x1 projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.kokoro.blocks import AdainResBlk1d, run_lstm
from mstar.model.vocoder import prefix_mask

__all__ = ["AdaLayerNorm", "DurationEncoder", "ProsodyPredictor"]


class AdaLayerNorm(nn.Module):
    """Layer norm over channels (no affine) modulated by the style: ``(1 + gamma) * x + beta``."""

    def __init__(self, style_dim: int, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.fc = nn.Linear(style_dim, 2 * channels)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, C]``, ``s`` ``[B, S]``."""
        gamma, beta = self.fc(s)[:, None].chunk(2, dim=-1)
        return (1 + gamma) * F.layer_norm(x, (x.shape[-1],), eps=self.eps) + beta


class DurationEncoder(nn.Module):
    """Features ``[B, C, T]`` + style -> ``[B, T, C + S]`` (style concatenated)."""

    def __init__(self, style_dim: int, d_model: int, nlayers: int) -> None:
        super().__init__()
        self.lstms = nn.ModuleList()
        for _ in range(nlayers):
            self.lstms.append(nn.LSTM(d_model + style_dim, d_model // 2, 1, batch_first=True, bidirectional=True))
            self.lstms.append(AdaLayerNorm(style_dim, d_model))

    def forward(self, x: torch.Tensor, s: torch.Tensor, lengths: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = x.shape[2]
        style = s[:, None].expand(-1, t, -1)  # [B, T, S]
        x = torch.cat([x.transpose(1, 2), style], dim=-1).masked_fill(pad[..., None], 0.0)  # [B, T, C + S]
        for block in self.lstms:
            if isinstance(block, AdaLayerNorm):
                x = torch.cat([block(x, s), style], dim=-1).masked_fill(pad[..., None], 0.0)
            else:
                x = run_lstm(block, x, lengths)
        return x


class ProsodyPredictor(nn.Module):
    def __init__(self, style_dim: int, d_hid: int, nlayers: int, max_dur: int) -> None:
        super().__init__()
        self.text_encoder = DurationEncoder(style_dim, d_hid, nlayers)
        self.lstm = nn.LSTM(d_hid + style_dim, d_hid // 2, 1, batch_first=True, bidirectional=True)
        self.duration_proj = _LinearNorm(d_hid, max_dur)
        self.shared = nn.LSTM(d_hid + style_dim, d_hid // 2, 1, batch_first=True, bidirectional=True)
        half = d_hid // 2
        self.F0 = nn.ModuleList([
            AdainResBlk1d(d_hid, d_hid, style_dim),
            AdainResBlk1d(d_hid, half, style_dim, upsample=True),
            AdainResBlk1d(half, half, style_dim),
        ])
        self.N = nn.ModuleList([
            AdainResBlk1d(d_hid, d_hid, style_dim),
            AdainResBlk1d(d_hid, half, style_dim, upsample=True),
            AdainResBlk1d(half, half, style_dim),
        ])
        self.F0_proj = nn.Conv1d(half, 1, 1)
        self.N_proj = nn.Conv1d(half, 1, 1)

    def durations(
        self, d: torch.Tensor, lengths: torch.Tensor, speed: torch.Tensor
    ) -> torch.Tensor:
        """Encoded features ``d`` ``[B, T, C + S]`` -> frames per phoneme ``[B, T]`` (float,
        before rounding); ``speed`` ``[B]``."""
        x = run_lstm(self.lstm, d, lengths)
        return torch.sigmoid(self.duration_proj(x)).sum(dim=-1) / speed[:, None]

    def f0_n(
        self,
        frames: torch.Tensor,
        s: torch.Tensor,
        lengths: list[int] | None = None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-frame features ``[B, C + S, F]`` -> F0 and energy ``[B, 2F]`` each; ``lengths``
        (host ints; ``counts`` the same on the device): rows padded to ``F``, row ``i`` valid
        for ``lengths[i]`` frames (the LSTM stops at it, the blocks mask past it; the curves
        are zero past ``2 * lengths[i]``)."""
        if lengths is None:
            x = self.shared(frames.transpose(1, 2))[0].transpose(1, 2)
            keep = None
        else:
            x = run_lstm(self.shared, frames.transpose(1, 2), torch.tensor(lengths)).transpose(1, 2)
            counts = torch.tensor(lengths, device=frames.device) if counts is None else counts
            keep = prefix_mask(counts, frames.shape[-1])
        f0, f0_keep = self._curve(self.F0, x, s, keep)
        n, _ = self._curve(self.N, x, s, keep)
        f0, n = self.F0_proj(f0).squeeze(1), self.N_proj(n).squeeze(1)
        if f0_keep is not None:
            f0, n = torch.where(f0_keep, f0, 0.0), torch.where(f0_keep, n, 0.0)
        return f0, n

    @staticmethod
    def _curve(
        blocks: nn.ModuleList, x: torch.Tensor, s: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        for block in blocks:
            x = block(x, s, keep)
            if block.upsample and keep is not None:
                keep = keep.repeat_interleave(2, dim=1)
        return x, keep


class _LinearNorm(nn.Module):
    """A linear layer under the checkpoint's name ``linear_layer``."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.linear_layer = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_layer(x)
