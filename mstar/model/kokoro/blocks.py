"""Small pieces shared by Kokoro's text, prosody and decoder halves (StyleTTS2's building
blocks): a bidirectional LSTM over padded rows, layer norm over channels, and the style-
modulated residual block ``AdainResBlk1d``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mstar.model.vocoder import AdaIN1d, zero_padding

__all__ = ["AdainResBlk1d", "run_lstm"]

_SQRT_HALF = 1 / math.sqrt(2)


def run_lstm(lstm: nn.LSTM, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``lstm`` over ``x`` ``[B, T, C]`` with each row stopping at its length (the backward
    direction starts at the row's last real step); padded steps come out as zeros."""
    if lengths is None or bool((lengths == x.shape[1]).all()):
        return lstm(x)[0]
    packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    out, _ = pad_packed_sequence(lstm(packed)[0], batch_first=True, total_length=x.shape[1])
    return out



class AdainResBlk1d(nn.Module):
    """``(residual(x) + shortcut(x)) / sqrt(2)``; residual: AdaIN, leaky ReLU (0.2), [2x
    depthwise transposed-conv upsampling], conv 3, AdaIN, leaky ReLU, conv 3; shortcut: [2x
    nearest upsampling], [1x1 conv when the width changes].

    ``keep`` ``[B, T]`` (rows padded to one length): the norms over each row's valid frames,
    the convolutions (the upsampling one too) reading zeros past a row's end; the output is
    valid for ``length`` frames (``2 * length`` with ``upsample``)."""

    def __init__(self, dim_in: int, dim_out: int, style_dim: int, upsample: bool = False) -> None:
        super().__init__()
        self.upsample = upsample
        self.norm1 = AdaIN1d(style_dim, dim_in)
        self.norm2 = AdaIN1d(style_dim, dim_out)
        self.conv1 = nn.Conv1d(dim_in, dim_out, 3, padding=1)
        self.conv2 = nn.Conv1d(dim_out, dim_out, 3, padding=1)
        if dim_in != dim_out:
            self.conv1x1 = nn.Conv1d(dim_in, dim_out, 1, bias=False)
        if upsample:
            self.pool = nn.ConvTranspose1d(dim_in, dim_in, 3, stride=2, groups=dim_in, padding=1, output_padding=1)

    def forward(self, x: torch.Tensor, s: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        y = self.norm1.activated(x, s, keep, "leaky_relu", slope=0.2)
        if self.upsample:
            keep = None if keep is None else keep.repeat_interleave(2, dim=1)
            y = zero_padding(self.pool(y), keep)
        y = self.conv1(y)
        y = self.conv2(self.norm2.activated(y, s, keep, "leaky_relu", slope=0.2))
        shortcut = F.interpolate(x, scale_factor=2, mode="nearest") if self.upsample else x
        if hasattr(self, "conv1x1"):
            shortcut = self.conv1x1(shortcut)
        return (y + shortcut) * _SQRT_HALF
