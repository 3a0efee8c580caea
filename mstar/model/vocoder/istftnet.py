"""The iSTFTNet generator with an NSF harmonic source (HiFT-style), conditioned on a style
vector through AdaIN: frames ``[B, C, T]``, a style ``[B, S]`` and F0 ``[B, T]`` -> audio.

The maths (Kokoro's ``istftnet.Generator``, after StyleTTS2 and HiFT):

- F0 (one value per generator input frame) is repeated to the sample rate, turned into the
  harmonic source (``HarmonicSource``) and analysed with the same STFT the output uses; its
  magnitude and phase (``n_fft + 2`` channels) are the source features;
- per upsampling stage ``i``: leaky ReLU (0.1), the transposed convolution ``ups[i]``, plus the
  source features brought to that stage's frame rate (``noise_convs[i]``, strided) and shaped
  by an AdaIN residual block (``noise_res[i]``); then the mean of ``len(resblock_kernel_sizes)``
  AdaIN residual blocks (``resblocks``); the last stage is padded by one frame on the left
  (reflection) to line up with the source;
- leaky ReLU (0.01), ``conv_post`` to ``n_fft + 2`` channels: ``exp`` of the first half is the
  magnitude, ``sin`` of the second half the phase, and the iSTFT gives the waveform.

Residual blocks use the Snake activation ``x + sin(a x)^2 / a`` with a learned per-channel
``a`` (``alpha1``/``alpha2``) after each AdaIN.

``forward_rows`` runs a batch of rows padded to one length, each row's audio equal to its solo
audio: a ``keep`` mask (a prefix per row) follows the frame rate through the stages; instance
norms take their statistics over a row's valid frames only (``masked_instance_norm``), every
convolution that mixes along time reads zeros past a row's end (as a solo row reads its zero
padding), the source is analysed and the output synthesised per row length
(``ISTFT.analyse_rows`` / ``synthesise_rows``), and each row's noise is drawn from its own
generator in its solo shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.triton_adain import adain_act
from mstar.model.vocoder.istft import ISTFT, prefix_mask
from mstar.model.vocoder.nsf import HarmonicSource

__all__ = ["AdaIN1d", "AdaINResBlock1", "ISTFTNetConfig", "ISTFTNetGenerator", "masked_instance_norm",
           "zero_padding"]


def _same_padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


def zero_padding(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[B, C, T]`` with the frames past each row's end set to zero (``where``, not a
    product, so an inf or nan in the padding cannot leak); ``keep`` ``None``: unpadded."""
    return x if keep is None else torch.where(keep[:, None], x, 0.0)


def masked_instance_norm(
    x: torch.Tensor, keep: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """``InstanceNorm1d`` (affine, biased variance) of ``[B, C, T]`` with each row's mean and
    variance taken over its valid frames only, so padding does not shift a row's statistics.
    The statistics are float32 whatever ``x`` is (a bf16 frame count is inexact past 256)."""
    valid = keep[:, None]
    xf = x.float()
    count = valid.sum(-1, keepdim=True).float()
    mean = torch.where(valid, xf, 0.0).sum(-1, keepdim=True) / count
    var = torch.where(valid, xf - mean, 0.0).pow(2).sum(-1, keepdim=True) / count
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.float()[:, None] + bias.float()[:, None]
    return y.to(x.dtype)


@dataclass(frozen=True)
class ISTFTNetConfig:
    """The generator's shape: Kokoro's ``config.json`` ``istftnet`` keys, plus the style width
    and the source's constants (Kokoro's are fixed in its code: 24 kHz, 8 overtones, voiced
    above 10 Hz)."""

    style_dim: int
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    upsample_initial_channel: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    gen_istft_n_fft: int
    gen_istft_hop_size: int
    sampling_rate: int = 24000
    harmonic_num: int = 8
    voiced_threshold: float = 10.0
    sine_amp: float = 0.1
    noise_std: float = 0.003
    source_resblock_kernel_sizes: tuple[int, int] = field(default=(7, 11))
    """Kernel of ``noise_res[i]``: the first for every stage but the last, the second for it."""

    def __post_init__(self) -> None:
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise ValueError("upsample_rates and upsample_kernel_sizes must have the same length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes must have the same length")

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per generator input frame (and per F0 value)."""
        return math.prod(self.upsample_rates) * self.gen_istft_hop_size


class AdaIN1d(nn.Module):
    """Instance norm (affine, as the checkpoints have it) modulated by the style:
    ``(1 + gamma(s)) * norm(x) + beta(s)``, ``[gamma | beta] = fc(s)``."""

    def __init__(self, style_dim: int, channels: int) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(channels, affine=True)
        self.fc = nn.Linear(style_dim, 2 * channels)

    def forward(self, x: torch.Tensor, s: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep`` ``[B, T]`` (padded rows): the statistics over each row's valid frames."""
        gamma, beta = self.fc(s).unsqueeze(-1).chunk(2, dim=1)
        if keep is None:
            normed = self.norm(x)
        else:
            normed = masked_instance_norm(x, keep, self.norm.weight, self.norm.bias, self.norm.eps)
        return (1 + gamma) * normed + beta

    fused = False
    """Whether ``activated`` runs as Triton kernels (``use_fused_kernels``; eager is the reference)."""

    def activated(self, x: torch.Tensor, s: torch.Tensor, keep: torch.Tensor | None, act: str,
                  alpha: torch.Tensor | None = None, slope: float = 0.2) -> torch.Tensor:
        """``zero_padding(act(self(x, s, keep)), keep)`` with ``act`` ``"snake"`` (``alpha``) or
        ``"leaky_relu"`` (``slope``): what every residual block feeds its next convolution."""
        if self.fused:
            gamma, beta = self.fc(s).chunk(2, dim=1)
            return adain_act(x, keep, self.norm.weight, self.norm.bias, self.norm.eps, gamma, beta, act, alpha, slope)
        y = self(x, s, keep)
        return zero_padding(_snake(y, alpha) if act == "snake" else F.leaky_relu(y, slope), keep)


def use_fused_kernels(module: nn.Module, enabled: bool = True) -> None:
    """Run every ``AdaIN1d.activated`` under ``module`` as the fused Triton kernels
    (``mstar.layers.triton_adain``; CUDA, or Triton's interpreter)."""
    for m in module.modules():
        if isinstance(m, AdaIN1d):
            m.fused = enabled


def _snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return x + (1 / alpha) * torch.sin(alpha * x) ** 2


class AdaINResBlock1(nn.Module):
    """Three residual pairs: AdaIN, Snake, dilated conv, then AdaIN, Snake, conv (dilation 1)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], style_dim: int) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_same_padding(kernel_size, d))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=_same_padding(kernel_size)) for _ in dilations
        )
        self.adain1 = nn.ModuleList(AdaIN1d(style_dim, channels) for _ in dilations)
        self.adain2 = nn.ModuleList(AdaIN1d(style_dim, channels) for _ in dilations)
        self.alpha1 = nn.ParameterList(nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations)
        self.alpha2 = nn.ParameterList(nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations)

    def forward(self, x: torch.Tensor, s: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep`` ``[B, T]``: padded rows (see ``ISTFTNetGenerator.forward_rows``)."""
        for conv1, conv2, norm1, norm2, a1, a2 in zip(
            self.convs1, self.convs2, self.adain1, self.adain2, self.alpha1, self.alpha2
        ):
            y = conv1(norm1.activated(x, s, keep, "snake", a1))
            y = conv2(norm2.activated(y, s, keep, "snake", a2))
            x = x + y
        return x


class ISTFTNetGenerator(nn.Module):
    """Frames ``[B, upsample_initial_channel, T]``, style ``[B, style_dim]`` and F0 ``[B, T]``
    -> waveform ``[B, 1, T * samples_per_frame]``."""

    def __init__(self, config: ISTFTNetConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.m_source = HarmonicSource(
            c.sampling_rate, c.samples_per_frame, c.harmonic_num, c.sine_amp, c.noise_std, c.voiced_threshold
        )
        self.stft = ISTFT(c.gen_istft_n_fft, c.gen_istft_hop_size)
        source_channels = c.gen_istft_n_fft + 2
        self.ups = nn.ModuleList()
        self.noise_convs = nn.ModuleList()
        self.noise_res = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        stages = len(c.upsample_rates)
        for i, (rate, kernel) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)):
            ch_in, ch = c.upsample_initial_channel // 2**i, c.upsample_initial_channel // 2 ** (i + 1)
            self.ups.append(nn.ConvTranspose1d(ch_in, ch, kernel, rate, padding=(kernel - rate) // 2))
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes):
                self.resblocks.append(AdaINResBlock1(ch, k, tuple(d), c.style_dim))
            if i + 1 < stages:
                stride = math.prod(c.upsample_rates[i + 1 :])
                self.noise_convs.append(
                    nn.Conv1d(source_channels, ch, 2 * stride, stride=stride, padding=(stride + 1) // 2)
                )
                self.noise_res.append(AdaINResBlock1(ch, c.source_resblock_kernel_sizes[0], (1, 3, 5), c.style_dim))
            else:
                self.noise_convs.append(nn.Conv1d(source_channels, ch, 1))
                self.noise_res.append(AdaINResBlock1(ch, c.source_resblock_kernel_sizes[1], (1, 3, 5), c.style_dim))
        last = c.upsample_initial_channel // 2**stages
        self.conv_post = nn.Conv1d(last, source_channels, 7, padding=3)

    def source_features(
        self, f0: torch.Tensor, *, noise: bool = True, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """F0 ``[B, T]`` -> the harmonic source's STFT magnitude and phase ``[B, n_fft + 2, frames]``."""
        # nearest-neighbour upsampling by the scale factor, as the reference computes it
        f0 = F.interpolate(f0[:, None], scale_factor=self.config.samples_per_frame, mode="nearest").transpose(1, 2)
        source = self.m_source(f0, noise=noise, generator=generator).squeeze(-1)
        magnitude, phase = self.stft.analyse(source)
        return torch.cat([magnitude, phase], dim=1)

    def forward(
        self,
        x: torch.Tensor,
        s: torch.Tensor,
        f0: torch.Tensor,
        *,
        noise: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        source = self.source_features(f0, noise=noise, generator=generator)
        kernels = len(self.config.resblock_kernel_sizes)
        stages = len(self.ups)
        for i, (up, to_stage, shape_source) in enumerate(zip(self.ups, self.noise_convs, self.noise_res)):
            x = up(F.leaky_relu(x, 0.1))
            if i == stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + shape_source(to_stage(source), s)
            blocks = self.resblocks[i * kernels : (i + 1) * kernels]
            total = blocks[0](x, s)
            for block in blocks[1:]:
                total = total + block(x, s)
            x = total / kernels
        x = self.conv_post(F.leaky_relu(x))
        bins = self.stft.bins
        return self.stft.synthesise(torch.exp(x[:, :bins]), torch.sin(x[:, bins:]))

    def forward_rows(
        self,
        x: torch.Tensor,
        s: torch.Tensor,
        f0: torch.Tensor,
        lengths: list[int],
        *,
        noise: bool = True,
        generators: list[torch.Generator | None] | None = None,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` of rows padded to one length: ``lengths`` (host ints) are the valid
        frames of ``x`` ``[B, C, T]`` and ``f0`` ``[B, T]``, ``counts`` the same on the device
        (given, no host-to-device copy is needed); ``generators`` (one per row) draw each
        row's noise. -> ``[B, 1, T * samples_per_frame]``, row ``i`` valid (and equal to its
        solo audio) for ``lengths[i] * samples_per_frame`` samples."""
        frames = torch.tensor(lengths, device=x.device) if counts is None else counts
        keep = prefix_mask(frames, x.shape[-1])
        spf = self.config.samples_per_frame
        source = self._source_rows(torch.where(keep, f0, 0.0), [n * spf for n in lengths], frames * spf, noise,
                                   generators or [None] * len(lengths))
        kernels = len(self.config.resblock_kernel_sizes)
        stages = len(self.ups)
        for i, (up, to_stage, shape_source) in enumerate(zip(self.ups, self.noise_convs, self.noise_res)):
            x = up(zero_padding(F.leaky_relu(x, 0.1), keep))
            keep = keep.repeat_interleave(self.config.upsample_rates[i], dim=1)
            if i == stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")
                keep = F.pad(keep, (1, 0), value=True)
            x = x + shape_source(to_stage(source), s, keep)
            blocks = self.resblocks[i * kernels : (i + 1) * kernels]
            total = blocks[0](x, s, keep)
            for block in blocks[1:]:
                total = total + block(x, s, keep)
            x = total / kernels
        x = zero_padding(self.conv_post(zero_padding(F.leaky_relu(x), keep)), keep)
        bins = self.stft.bins
        return self.stft.synthesise_rows(torch.exp(x[:, :bins]), torch.sin(x[:, bins:]), keep)

    def _source_rows(
        self,
        f0: torch.Tensor,
        samples: list[int],
        sample_counts: torch.Tensor,
        noise: bool,
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """``source_features`` of padded rows (``f0`` zero past each row's end, so the phase
        stays flat there and a row's last frame interpolates as at a solo edge); the noise
        of row ``i`` is drawn from ``generators[i]`` in its solo order and shape (initial
        phases, then ``[H + 1, samples[i]]``), so it equals the row's solo draws."""
        f0 = F.interpolate(f0[:, None], scale_factor=self.config.samples_per_frame, mode="nearest").transpose(1, 2)
        table = None
        if noise:
            harmonics = self.config.harmonic_num + 1
            table = f0.new_zeros(f0.shape[0], f0.shape[1], harmonics)
            for row, (n, generator) in enumerate(zip(samples, generators)):
                # the initial phases: they do not reach the output (nsf.py), drawn to keep the sequence
                torch.rand(1, harmonics, generator=generator, device=f0.device, dtype=f0.dtype)
                draws = torch.empty(1, harmonics, n, device=f0.device, dtype=f0.dtype).transpose(1, 2)
                table[row, :n] = draws.normal_(generator=generator)[0]
        source = self.m_source(f0, noise=noise, noise_table=table).squeeze(-1)
        magnitude, phase = self.stft.analyse_rows(source, sample_counts)
        return torch.cat([magnitude, phase], dim=1)
