"""VITS stochastic duration predictor, inference direction only.

Noise ``[B, 2, T]`` (scaled by ``noise_w``) flows backwards through neural-spline coupling
layers conditioned on the text encoder's hidden states; the first channel of the result is the
log-duration per phoneme. Training-only parts (the posterior flows, the last forward flow the
reverse pass skips) are not in Piper's export, so they are not here either.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from mstar.layers.norm import ChannelLayerNorm
from mstar.model.piper.config import PiperArch

__all__ = ["DurationPredictor", "inverse_rational_quadratic"]

_MIN_BIN = 1e-3
_MIN_DERIVATIVE = 1e-3


class DilatedDepthSeparableConv(nn.Module):
    """``DDSConv``: depthwise convolutions with dilation ``k**i``, each followed by a 1x1."""

    def __init__(self, channels: int, kernel_size: int, n_layers: int) -> None:
        super().__init__()
        self.convs_sep = nn.ModuleList()
        for i in range(n_layers):
            dilation = kernel_size**i
            self.convs_sep.append(nn.Conv1d(channels, channels, kernel_size, groups=channels, dilation=dilation,
                                            padding=(kernel_size * dilation - dilation) // 2))
        self.convs_1x1 = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(n_layers))
        self.norms_1 = nn.ModuleList(ChannelLayerNorm(channels) for _ in range(n_layers))
        self.norms_2 = nn.ModuleList(ChannelLayerNorm(channels) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """Residual stack over ``[B, C, T]``; ``g`` (same shape) is added first when given."""
        if g is not None:
            x = x + g
        for sep, norm_1, one, norm_2 in zip(self.convs_sep, self.norms_1, self.convs_1x1, self.norms_2, strict=True):
            y = F.gelu(norm_1(sep(x * mask)))
            y = F.gelu(norm_2(one(y)))
            x = x + y
        return x * mask


def _bins(unnormalised: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bin edges ``[..., K+1]`` and sizes ``[..., K]`` of a spline axis on ``[low, high]``."""
    k = unnormalised.shape[-1]
    sizes = _MIN_BIN + (1 - _MIN_BIN * k) * torch.softmax(unnormalised, dim=-1)
    edges = F.pad(torch.cumsum(sizes, dim=-1), (1, 0), value=0.0) * (high - low) + low
    edges = torch.cat([torch.full_like(edges[..., :1], low), edges[..., 1:-1], torch.full_like(edges[..., :1], high)],
                      dim=-1)
    return edges, edges[..., 1:] - edges[..., :-1]


def inverse_rational_quadratic(y: torch.Tensor, widths: torch.Tensor, heights: torch.Tensor,
                               derivatives: torch.Tensor, tail_bound: float) -> torch.Tensor:
    """Invert a monotone rational-quadratic spline on ``[-B, B]`` with identity tails.

    ``widths``/``heights``: ``[..., K]`` unnormalised; ``derivatives``: ``[..., K-1]`` at the
    interior knots (the end knots get derivative 1, so the tails join smoothly). Solves the
    per-bin quadratic in the numerically stable form of Durkan et al. (2019).
    """
    inside = (y >= -tail_bound) & (y <= tail_bound)
    end = math.log(math.exp(1 - _MIN_DERIVATIVE) - 1)
    derivatives = F.pad(derivatives, (1, 1), value=end)
    cum_w, w = _bins(widths, -tail_bound, tail_bound)
    cum_h, h = _bins(heights, -tail_bound, tail_bound)
    d = _MIN_DERIVATIVE + F.softplus(derivatives)
    search = torch.cat([cum_h[..., :-1], cum_h[..., -1:] + 1e-6], dim=-1)
    yc = y.clamp(-tail_bound, tail_bound)
    idx = (torch.sum(yc[..., None] >= search, dim=-1) - 1).clamp(0, w.shape[-1] - 1)[..., None]

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(-1, idx)[..., 0]

    x0, bw, y0, bh = pick(cum_w), pick(w), pick(cum_h), pick(h)
    delta = pick(h / w)
    d0, d1 = pick(d[..., :-1]), pick(d[..., 1:])
    dy = yc - y0
    a = dy * (d0 + d1 - 2 * delta) + bh * (delta - d0)
    b = bh * d0 - dy * (d0 + d1 - 2 * delta)
    c = -delta * dy
    root = (2 * c) / (-b - torch.sqrt(b.pow(2) - 4 * a * c))
    return torch.where(inside, root * bw + x0, y)


class ConvFlow(nn.Module):
    """Spline coupling: half the channels set the spline that transforms the other half."""

    def __init__(self, channels: int, kernel_size: int, n_layers: int, num_bins: int, tail_bound: float) -> None:
        super().__init__()
        self.filter_channels = channels
        self.num_bins = num_bins
        self.tail_bound = tail_bound
        self.pre = nn.Conv1d(1, channels, 1)
        self.convs = DilatedDepthSeparableConv(channels, kernel_size, n_layers)
        self.proj = nn.Conv1d(channels, 3 * num_bins - 1, 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Undo the coupling on ``x``: ``[B, 2, T]``."""
        x0, x1 = x[:, :1], x[:, 1:]
        h = self.proj(self.convs(self.pre(x0), mask, g=g)) * mask
        h = h.unsqueeze(1).permute(0, 1, 3, 2)  # [B, 1, T, 3K-1]
        scale = math.sqrt(self.filter_channels)
        k = self.num_bins
        x1 = inverse_rational_quadratic(x1, h[..., :k] / scale, h[..., k:2 * k] / scale, h[..., 2 * k:],
                                        self.tail_bound)
        return torch.cat([x0, x1], dim=1) * mask


class ElementwiseAffine(nn.Module):
    """Per-channel affine ``y = m + exp(logs) * x`` (reverse divides it back out)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.zeros(channels, 1))
        self.logs = nn.Parameter(torch.zeros(channels, 1))

    def reverse(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Undo the affine."""
        return (x - self.m) * torch.exp(-self.logs) * mask


class DurationPredictor(nn.Module):
    """``dp``: hidden states and noise to log-durations ``[B, 1, T]``.

    The module list keeps the reference's indices (affine at 0, spline flows at 3, 5, 7 with
    flips between) so the released names map one to one; index 1, the flow the reference's
    reverse pass drops, is absent from the export and from here.
    """

    def __init__(self, arch: PiperArch) -> None:
        super().__init__()
        fc = arch.dp_filter_channels
        self.pre = nn.Conv1d(arch.hidden, fc, 1)
        self.convs = DilatedDepthSeparableConv(fc, arch.dp_kernel_size, 3)
        self.proj = nn.Conv1d(fc, fc, 1)
        self.cond = nn.Conv1d(arch.gin_channels, fc, 1) if arch.gin_channels else None
        flows: dict[str, nn.Module] = {"0": ElementwiseAffine(2)}
        for i in range(1, arch.dp_n_flows):
            flows[str(2 * i + 1)] = ConvFlow(fc, arch.dp_kernel_size, 3, arch.dp_num_bins, arch.dp_tail_bound)
        self.flows = nn.ModuleDict(flows)
        self.n_flows = arch.dp_n_flows

    def forward(self, x: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor,
                g: torch.Tensor | None = None) -> torch.Tensor:
        """``noise``: ``[B, 2, T]`` already scaled by ``noise_w``; returns log-durations."""
        x = self.pre(x)
        if self.cond is not None and g is not None:
            x = x + self.cond(g)
        x = self.proj(self.convs(x, mask)) * mask
        z = noise
        for i in reversed(range(1, self.n_flows)):
            z = torch.flip(z, [1])
            z = self.flows[str(2 * i + 1)].reverse(z, mask, x)
        z = torch.flip(z, [1])
        z = self.flows["0"].reverse(z, mask)
        return z[:, :1]
