"""The two stages after length regulation: the normalising flow run backwards (prior sample
to posterior latent) and the HiFi-GAN generator (latent frames to a waveform).

Weight norm is removed before Piper exports, so every convolution here is plain.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mstar.model.piper.config import PiperArch

__all__ = ["Generator", "ResidualCouplingFlow"]

_LRELU_SLOPE = 0.1


class WaveNet(nn.Module):
    """``WN``: gated dilated convolutions with residual and skip paths (non-causal)."""

    def __init__(self, hidden: int, kernel_size: int, dilation_rate: int, n_layers: int, gin_channels: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.in_layers = nn.ModuleList()
        self.res_skip_layers = nn.ModuleList()
        for i in range(n_layers):
            dilation = dilation_rate**i
            self.in_layers.append(nn.Conv1d(hidden, 2 * hidden, kernel_size, dilation=dilation,
                                            padding=(kernel_size * dilation - dilation) // 2))
            out = 2 * hidden if i < n_layers - 1 else hidden
            self.res_skip_layers.append(nn.Conv1d(hidden, out, 1))
        self.cond_layer = nn.Conv1d(gin_channels, 2 * hidden * n_layers, 1) if gin_channels else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the skip outputs, masked."""
        out = torch.zeros_like(x)
        cond = self.cond_layer(g) if self.cond_layer is not None and g is not None else None
        last = len(self.in_layers) - 1
        for i, (conv, res_skip) in enumerate(zip(self.in_layers, self.res_skip_layers, strict=True)):
            a = conv(x)
            if cond is not None:
                a = a + cond[:, 2 * self.hidden * i:2 * self.hidden * (i + 1)]
            acts = torch.tanh(a[:, :self.hidden]) * torch.sigmoid(a[:, self.hidden:])
            rs = res_skip(acts)
            if i < last:
                x = (x + rs[:, :self.hidden]) * mask
                out = out + rs[:, self.hidden:]
            else:
                out = out + rs
        return out * mask


class CouplingLayer(nn.Module):
    """Mean-only affine coupling: the first half predicts a shift of the second half."""

    def __init__(self, arch: PiperArch) -> None:
        super().__init__()
        half = arch.inter_channels // 2
        self.pre = nn.Conv1d(half, arch.hidden, 1)
        self.enc = WaveNet(arch.hidden, arch.flow_kernel_size, arch.flow_dilation_rate, arch.flow_n_layers,
                           arch.gin_channels)
        self.post = nn.Conv1d(arch.hidden, half, 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """Subtract the predicted shift from the second half."""
        x0, x1 = x.chunk(2, dim=1)
        h = self.enc(self.pre(x0) * mask, mask, g)
        shift = self.post(h) * mask
        return torch.cat([x0, (x1 - shift) * mask], dim=1)


class ResidualCouplingFlow(nn.Module):
    """``flow``: couplings at even indices, channel flips at odd ones (no weights)."""

    def __init__(self, arch: PiperArch) -> None:
        super().__init__()
        self.flows = nn.ModuleDict({str(2 * i): CouplingLayer(arch) for i in range(arch.flow_n_couplings)})
        self.n_couplings = arch.flow_n_couplings

    def reverse(self, z: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """Prior sample to latent: undo flip then coupling, last to first."""
        for i in reversed(range(self.n_couplings)):
            z = torch.flip(z, [1])
            z = self.flows[str(2 * i)].reverse(z, mask, g)
        return z


class ResBlock1(nn.Module):
    """HiFi-GAN residual block type 1: pairs of (dilated, plain) convolutions."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                              padding=(kernel_size * d - d) // 2) for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2)
                                    for _ in dilations)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Residual refinement at one resolution; ``mask`` keeps padding at zero."""
        for c1, c2 in zip(self.convs1, self.convs2, strict=True):
            y = c1(F.leaky_relu(x, _LRELU_SLOPE)) * mask
            x = x + c2(F.leaky_relu(y, _LRELU_SLOPE)) * mask
        return x


class ResBlock2(nn.Module):
    """HiFi-GAN residual block type 2: one dilated convolution per residual step."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                             padding=(kernel_size * d - d) // 2) for d in dilations)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Residual refinement at one resolution; ``mask`` keeps padding at zero."""
        for conv in self.convs:
            x = x + conv(F.leaky_relu(x, _LRELU_SLOPE)) * mask
        return x


class Generator(nn.Module):
    """``dec``: HiFi-GAN upsampling stack, ``hop_length`` samples per latent frame.

    The reference leaves convolution biases in the padding of a batch, which then leak into
    the real samples near a short row's end. We zero the padding after every convolution
    instead, so each row of a batch computes exactly what it computes alone; for a row that
    fills the batch the masks are all ones and change nothing.
    """

    def __init__(self, arch: PiperArch) -> None:
        super().__init__()
        ch = arch.upsample_initial_channel
        self.conv_pre = nn.Conv1d(arch.inter_channels, ch, 7, padding=3)
        self.cond = nn.Conv1d(arch.gin_channels, ch, 1) if arch.gin_channels else None
        block = ResBlock1 if arch.resblock == "1" else ResBlock2
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, k) in enumerate(zip(arch.upsample_rates, arch.upsample_kernel_sizes, strict=True)):
            out = ch // 2 ** (i + 1)
            self.ups.append(nn.ConvTranspose1d(ch // 2**i, out, k, rate, padding=(k - rate) // 2))
            for rk, dil in zip(arch.resblock_kernel_sizes, arch.resblock_dilation_sizes, strict=True):
                self.resblocks.append(block(out, rk, dil))
        self.conv_post = nn.Conv1d(out, 1, 7, padding=3, bias=False)
        self.n_kernels = len(arch.resblock_kernel_sizes)
        self.rates = arch.upsample_rates

    def forward(self, z: torch.Tensor, lengths: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """``z``: ``[B, C, T]`` with ``lengths`` frames per row to audio ``[B, 1, T * hop]``."""
        frames = torch.arange(z.shape[-1], device=z.device)
        mask = (frames[None, :] < lengths[:, None]).unsqueeze(1).to(z.dtype)
        x = self.conv_pre(z) * mask
        if self.cond is not None and g is not None:
            x = (x + self.cond(g)) * mask
        for i, up in enumerate(self.ups):
            mask = mask.repeat_interleave(self.rates[i], dim=-1)
            x = up(F.leaky_relu(x, _LRELU_SLOPE)) * mask
            blocks = self.resblocks[i * self.n_kernels:(i + 1) * self.n_kernels]
            x = sum(block(x, mask) for block in blocks) / self.n_kernels
        return torch.tanh(self.conv_post(F.leaky_relu(x))) * mask
