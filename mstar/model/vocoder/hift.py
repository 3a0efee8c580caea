"""The HiFT vocoder (HiFTNet: an NSF harmonic source feeding an iSTFTNet-style HiFi-GAN), as
CosyVoice2/3 and Chatterbox's S3Gen use it: mel frames ``[B, n_mels, T]`` -> 24 kHz audio.

The maths (CosyVoice's ``HiFTGenerator`` and ``ConvRNNF0Predictor``):

- the F0 predictor reads the mel: five ``kernel 3`` convolutions with ELU (``condnet``), a
  linear layer to one value per frame (``classifier``), absolute value -> F0 in Hz ``[B, T]``;
- F0 is repeated to the sample rate (nearest, ``prod(upsample_rates) * hop`` samples a frame)
  and turned into the harmonic excitation by the same hn-NSF source as Kokoro's
  (``HarmonicSource``: fundamental plus ``nb_harmonics`` overtones, phase summed on the frame
  grid, voiced above ``nsf_voiced_threshold``);
- the excitation's STFT, as real and imaginary parts (``n_fft + 2`` channels; Kokoro uses
  magnitude and phase), is brought to each upsampling stage's frame rate by ``source_downs[i]``
  (strided, kernel ``2u``, padding ``u // 2``; a 1x1 conv at the last stage) and shaped by a
  Snake residual block ``source_resblocks[i]``;
- the mel goes through ``conv_pre`` (kernel 7), then per stage: leaky ReLU (``lrelu_slope``),
  ``ups[i]``, a one-frame reflection pad on the left at the last stage, plus the source
  features, then the mean of the stage's Snake residual blocks (``resblocks``);
- leaky ReLU (0.01), ``conv_post`` to ``n_fft + 2`` channels: ``exp`` of the first half
  (capped at 100) is the magnitude, ``sin`` of the second half the phase; the iSTFT output is
  clamped to ``+-audio_limit``.

The residual blocks carry no style (unlike Kokoro's AdaIN blocks): Snake, dilated conv,
Snake, conv, residual, per dilation; Snake is ``x + sin(a x)^2 / (a + 1e-9)`` with a learned
per-channel ``a`` (``activations1.<j>.alpha``, shape ``[C]``).

CosyVoice1's 22.05 kHz HiFT draws its sines differently (phase summed per sample, uniform
initial phases); that source is not implemented, and the config refuses 22050 Hz.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.vocoder.istft import ISTFT
from mstar.model.vocoder.nsf import HarmonicSource
from mstar.model.vocoder.weight_norm import fold_weight_norm

__all__ = ["F0Predictor", "HiFTConfig", "HiFTGenerator", "SnakeResBlock", "hift_state"]

_MAX_MAGNITUDE = 100.0


def _same_padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


@dataclass(frozen=True)
class HiFTConfig:
    """The generator's shape: CosyVoice2's ``hift`` block of its ``cosyvoice2.yaml`` (the
    defaults are CosyVoice2-0.5B's), plus the F0 predictor's width."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_length: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512

    def __post_init__(self) -> None:
        stages = len(self.upsample_rates)
        if len(self.upsample_kernel_sizes) != stages:
            raise ValueError("upsample_rates and upsample_kernel_sizes must have the same length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes must have the same length")
        if not len(self.source_resblock_kernel_sizes) == len(self.source_resblock_dilation_sizes) == stages:
            raise ValueError("source_resblock_kernel_sizes/dilation_sizes need one entry per upsampling stage")
        if self.sampling_rate == 22050:
            raise ValueError("sampling_rate 22050 selects CosyVoice1's per-sample sine source, not implemented")

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per mel frame (and per F0 value)."""
        return math.prod(self.upsample_rates) * self.hop_length


class SnakeResBlock(nn.Module):
    """HiFi-GAN/BigVGAN residual block with Snake activations, one pair of convs per dilation."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_same_padding(kernel_size, d))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=_same_padding(kernel_size)) for _ in dilations
        )
        self.activations1 = nn.ModuleList(_Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(_Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class _Snake(nn.Module):
    """``x + sin(a x)^2 / (a + 1e-9)``, ``a`` per channel (the checkpoint's ``alpha``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[:, None]
        return x + torch.sin(alpha * x) ** 2 / (alpha + 1e-9)


class F0Predictor(nn.Module):
    """Mel ``[B, in_channels, T]`` -> F0 in Hz ``[B, T]`` (CosyVoice's ``ConvRNNF0Predictor``;
    despite the name, convolutions only). ``condnet.<2i>`` are the convs, ELU between."""

    def __init__(self, in_channels: int, cond_channels: int, layers: int = 5) -> None:
        super().__init__()
        convs: list[nn.Module] = []
        for i in range(layers):
            convs += [nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*convs)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class HiFTGenerator(nn.Module):
    """Mel ``[B, in_channels, T]`` -> waveform ``[B, T * samples_per_frame]`` and the harmonic
    excitation ``[B, 1, T * samples_per_frame]`` it was made from."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.f0_predictor = F0Predictor(c.in_channels, c.f0_cond_channels)
        self.m_source = HarmonicSource(
            c.sampling_rate, c.samples_per_frame, c.nb_harmonics, c.nsf_alpha, c.nsf_sigma, c.nsf_voiced_threshold
        )
        self.stft = ISTFT(c.n_fft, c.hop_length)
        source_channels = c.n_fft + 2
        self.conv_pre = nn.Conv1d(c.in_channels, c.base_channels, 7, padding=3)
        self.ups = nn.ModuleList()
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)):
            ch_in, ch = c.base_channels // 2**i, c.base_channels // 2 ** (i + 1)
            self.ups.append(nn.ConvTranspose1d(ch_in, ch, kernel, rate, padding=(kernel - rate) // 2))
            stride = math.prod(c.upsample_rates[i + 1 :])  # source frames per this stage's frame
            if stride == 1:
                self.source_downs.append(nn.Conv1d(source_channels, ch, 1))
            else:
                self.source_downs.append(nn.Conv1d(source_channels, ch, 2 * stride, stride, padding=stride // 2))
            self.source_resblocks.append(
                SnakeResBlock(ch, c.source_resblock_kernel_sizes[i], tuple(c.source_resblock_dilation_sizes[i]))
            )
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes):
                self.resblocks.append(SnakeResBlock(ch, k, tuple(d)))
        self.conv_post = nn.Conv1d(c.base_channels // 2 ** len(c.upsample_rates), source_channels, 7, padding=3)

    def excitation(
        self, f0: torch.Tensor, *, noise: bool = True, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """F0 ``[B, T]`` -> the harmonic source ``[B, 1, T * samples_per_frame]``."""
        f0 = F.interpolate(f0[:, None], scale_factor=self.config.samples_per_frame, mode="nearest")
        return self.m_source(f0.transpose(1, 2), noise=noise, generator=generator).transpose(1, 2)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Mel ``[B, in_channels, T]`` and the excitation ``[B, 1, L]`` -> waveform ``[B, L]``."""
        c = self.config
        real, imag = self.stft.analyse_complex(source.squeeze(1))
        source_spec = torch.cat([real, imag], dim=1)
        x = self.conv_pre(mel)
        kernels = len(c.resblock_kernel_sizes)
        stages = len(self.ups)
        for i, (up, down, shape_source) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks)):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + shape_source(down(source_spec))
            blocks = self.resblocks[i * kernels : (i + 1) * kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / kernels
        x = self.conv_post(F.leaky_relu(x))
        bins = self.stft.bins
        wave = self.stft.synthesise(torch.exp(x[:, :bins]), torch.sin(x[:, bins:]), max_magnitude=_MAX_MAGNITUDE)
        return wave.squeeze(1).clamp(-c.audio_limit, c.audio_limit)

    def forward(
        self,
        mel: torch.Tensor,
        *,
        cache_source: torch.Tensor | None = None,
        noise: bool = True,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel -> (waveform ``[B, L]``, excitation ``[B, 1, L]``). ``cache_source`` (the
        excitation a previous call returned for the overlapping head of this mel) replaces the
        head of the new excitation, as CosyVoice's streaming does to avoid a phase glitch."""
        source = self.excitation(self.f0_predictor(mel), noise=noise, generator=generator)
        if cache_source is not None and cache_source.shape[-1]:
            source = torch.cat([cache_source, source[..., cache_source.shape[-1] :]], dim=-1)
        return self.decode(mel, source), source


def hift_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A released ``hift.pt`` state dict as ``HiFTGenerator`` names it: the ``generator.``
    prefix of checkpoints saved from the GAN trainer dropped (CosyVoice's loader does the same)
    and weight-norm pairs (``weight_g``/``weight_v`` or parametrization names) folded."""
    return fold_weight_norm({name.removeprefix("generator."): tensor for name, tensor in state.items()})
