"""The LTX-2.x vocoder: a stereo mel spectrogram -> a waveform.

Two layouts, as diffusers 0.42.1 has them (parameter and buffer names equal its keys):

* ``LTX2Vocoder`` (LTX-2.0, 24 kHz): a HiFi-GAN style generator. A 1D convolution over the
  (channel x mel) features, then per stage a transposed convolution upsampling time and the mean
  of a few dilated residual stacks of different kernel sizes, then an output convolution.
  Activations are leaky ReLU, or Snake (``x + sin(a x)^2 / b``) run at twice the rate between
  Kaiser-windowed sinc filters (anti-aliased, BigVGAN's design).
* ``LTX2VocoderWithBWE`` (LTX-2.3 and later, 48 kHz): that generator makes a 16 kHz waveform,
  a fixed causal STFT + mel filterbank (checkpoint buffers) turns it back into a mel
  spectrogram, a second generator predicts the 48 kHz detail from it, added to the 16 kHz
  waveform resampled x3 by a Hann-windowed sinc; clamped to [-1, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def kaiser_lowpass(cutoff: float, half_width: float, size: int) -> torch.Tensor:
    """A ``size``-tap low-pass FIR (cutoff as a fraction of the sampling rate, transition band
    ``half_width``): a sinc under a Kaiser window whose beta follows Kaiser's attenuation rule,
    normalised to unit DC gain; computed in float32 whatever the default dtype."""
    half = size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(size, beta=beta, periodic=False, dtype=torch.float32)
    if size % 2 == 0:
        taps = torch.arange(-half, half, dtype=torch.float32) + 0.5
    else:
        taps = torch.arange(size, dtype=torch.float32) - half
    if cutoff == 0.0:
        return torch.zeros_like(taps)
    arg = 2 * cutoff * taps
    sinc = torch.where(arg == 0, torch.ones_like(arg), torch.sin(math.pi * arg) / math.pi / arg)
    fir = 2 * cutoff * window * sinc
    return fir / fir.sum()


class Downsample1d(nn.Module):
    """Low-pass then keep every ``ratio``-th sample (edge-replicated padding)."""

    def __init__(self, ratio: int, size: int) -> None:
        super().__init__()
        self.ratio, self.pad = ratio, (size // 2 + size % 2 - 1, size // 2)
        fir = kaiser_lowpass(0.5 / ratio, 0.6 / ratio, size).to(torch.get_default_dtype())  # as a cast gave
        self.register_buffer("filter", fir.view(1, 1, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, self.pad, mode="replicate")
        return F.conv1d(x, self.filter.expand(x.shape[1], -1, -1), stride=self.ratio, groups=x.shape[1])


class Upsample1d(nn.Module):
    """Zero-stuff by ``ratio`` and low-pass (a transposed convolution), edge-replicated padding;
    the Kaiser filter of the anti-aliased activations or the Hann-windowed sinc resampler."""

    def __init__(self, ratio: int, size: int = 12, window: str = "kaiser", persistent: bool = True) -> None:
        super().__init__()
        self.ratio = ratio
        if window == "hann":
            rolloff, zeros = 0.99, 6
            width = math.ceil(zeros / rolloff)
            size = 2 * width * ratio + 1
            self.pad, self.crop = width, (2 * width * ratio, size - ratio)
            t = (torch.arange(size, dtype=torch.float32) / ratio - width) * rolloff
            taper = torch.cos(t.clamp(-zeros, zeros) * math.pi / zeros / 2) ** 2
            fir = torch.sinc(t) * taper * rolloff / ratio
        else:
            self.pad = size // ratio - 1
            self.crop = (self.pad * ratio + (size - ratio) // 2, self.pad * ratio + (size - ratio + 1) // 2)
            fir = kaiser_lowpass(0.5 / ratio, 0.6 / ratio, size)
        # computed in float32, then in the model's dtype (as a cast of a float32 build gave)
        self.register_buffer("filter", fir.view(1, 1, size).to(torch.get_default_dtype()), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        fir = self.filter.to(x.dtype).expand(channels, -1, -1)
        x = self.ratio * F.conv_transpose1d(x, fir, stride=self.ratio, groups=channels)
        return x[..., self.crop[0]:-self.crop[1]]


class Snake(nn.Module):
    """``x + sin(alpha x)^2 / (amp + 1e-9)`` per channel, ``alpha`` and ``beta`` stored as logs;
    ``amp`` is ``beta`` (SnakeBeta) or ``alpha`` (plain Snake, no ``beta`` parameter)."""

    def __init__(self, channels: int, use_beta: bool) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels)) if use_beta else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        amp = alpha if self.beta is None else self.beta.exp()[None, :, None]
        return x + (1.0 / (amp + 1e-9)) * torch.sin(x * alpha).pow(2)


class AntiAliased(nn.Module):
    """An activation run at ``ratio`` times the rate: upsample, ``act``, downsample."""

    def __init__(self, act: nn.Module, ratio: int, size: int) -> None:
        super().__init__()
        self.upsample = Upsample1d(ratio, size)
        self.act = act
        self.downsample = Downsample1d(ratio, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


class ResStack(nn.Module):
    """Pairs of (activation, dilated conv, activation, conv) with a residual around each pair."""

    def __init__(self, channels: int, kernel: int, dilations: list[int], c: Mapping[str, Any]) -> None:
        super().__init__()

        def conv(dilation: int) -> nn.Conv1d:
            return nn.Conv1d(channels, channels, kernel, dilation=dilation, padding="same")

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.acts1 = nn.ModuleList(make_act(channels, c) for _ in dilations)
        self.acts2 = nn.ModuleList(make_act(channels, c) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.acts1, self.convs1, self.acts2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


def make_act(channels: int, c: Mapping[str, Any]) -> nn.Module:
    kind = c["act_fn"]
    if kind == "leaky_relu":
        return nn.LeakyReLU(c["leaky_relu_negative_slope"])
    act = Snake(channels, use_beta=kind == "snakebeta")
    return AntiAliased(act, c["antialias_ratio"], c["antialias_kernel_size"]) if c["antialias"] else act


GENERATOR_DEFAULTS: dict[str, Any] = dict(
    in_channels=128, hidden_channels=1024, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
    upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11], resnet_dilations=[[1, 3, 5]] * 3,
    act_fn="leaky_relu", leaky_relu_negative_slope=0.1, antialias=False, antialias_ratio=2,
    antialias_kernel_size=12, final_act_fn="tanh", final_bias=True, output_sampling_rate=24000)


class Generator(nn.Module):
    """Mel ``[B, C, frames, bins]`` -> waveform ``[B, out_channels, frames x prod(factors)]``
    (diffusers' ``LTX2Vocoder`` keys)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        c = {**GENERATOR_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
        unknown = sorted(set(c) - set(GENERATOR_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown LTX2Vocoder config keys: {unknown}")
        if c["act_fn"] not in ("leaky_relu", "snake", "snakebeta"):
            raise ValueError(f"vocoder config: act_fn {c['act_fn']!r} is not supported")
        if c["act_fn"] == "leaky_relu" and c["antialias"]:
            raise ValueError("vocoder config: antialias with leaky_relu is not supported")
        self.config = c
        self.slope, self.stacks = c["leaky_relu_negative_slope"], len(c["resnet_kernel_sizes"])
        width = c["hidden_channels"]
        self.conv_in = nn.Conv1d(c["in_channels"], width, 7, padding=3)
        self.upsamplers, self.resnets = nn.ModuleList(), nn.ModuleList()
        for factor, kernel in zip(c["upsample_factors"], c["upsample_kernel_sizes"]):
            self.upsamplers.append(nn.ConvTranspose1d(width, width // 2, kernel, stride=factor,
                                                      padding=(kernel - factor) // 2))
            width //= 2
            for k, dilations in zip(c["resnet_kernel_sizes"], c["resnet_dilations"]):
                self.resnets.append(ResStack(width, k, dilations, c))
        if c["act_fn"] == "leaky_relu":
            self.act_out = nn.LeakyReLU()  # slope 0.01, not the configured one (as the reference)
        else:
            self.act_out = AntiAliased(Snake(width, use_beta=True), c["antialias_ratio"], c["antialias_kernel_size"])
        self.conv_out = nn.Conv1d(width, c["out_channels"], 7, padding=3, bias=c["final_bias"])

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(mel.transpose(2, 3).flatten(1, 2))
        for i, up in enumerate(self.upsamplers):
            if self.config["act_fn"] == "leaky_relu":
                x = F.leaky_relu(x, self.slope)
            x = up(x)
            stacks = self.resnets[i * self.stacks:(i + 1) * self.stacks]
            x = torch.stack([stack(x) for stack in stacks]).mean(dim=0)
        x = self.conv_out(self.act_out(x))
        if self.config["final_act_fn"] == "tanh":
            return torch.tanh(x)
        if self.config["final_act_fn"] == "clamp":
            return x.clamp(-1, 1)
        return x

    @property
    def sampling_rate(self) -> int:
        return self.config["output_sampling_rate"]


class CausalStft(nn.Module):
    """Magnitudes of a left-padded STFT whose windowed DFT bases are checkpoint buffers."""

    def __init__(self, filter_length: int, hop: int, window: int) -> None:
        super().__init__()
        self.hop, self.left = hop, max(0, window - hop)
        bins = filter_length // 2 + 1
        self.register_buffer("forward_basis", torch.zeros(2 * bins, 1, filter_length))
        self.register_buffer("inverse_basis", torch.zeros(2 * bins, 1, filter_length))  # loaded, unused

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        spec = F.conv1d(F.pad(wave[:, None], (self.left, 0)), self.forward_basis, stride=self.hop)
        real, imag = spec.chunk(2, dim=1)
        return torch.sqrt(real**2 + imag**2)


class MelStft(nn.Module):
    def __init__(self, filter_length: int, hop: int, window: int, mels: int) -> None:
        super().__init__()
        self.stft_fn = CausalStft(filter_length, hop, window)
        self.register_buffer("mel_basis", torch.zeros(mels, filter_length // 2 + 1))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        """``[N, samples]`` -> log mel ``[N, mels, frames]``."""
        magnitude = self.stft_fn(wave)
        return torch.log(torch.clamp(self.mel_basis.to(magnitude.dtype) @ magnitude, min=1e-5))


BWE_DEFAULTS: dict[str, Any] = dict(
    in_channels=128, hidden_channels=1536, out_channels=2, upsample_kernel_sizes=[11, 4, 4, 4, 4, 4],
    upsample_factors=[5, 2, 2, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11], resnet_dilations=[[1, 3, 5]] * 3,
    act_fn="snakebeta", leaky_relu_negative_slope=0.1, antialias=True, antialias_ratio=2, antialias_kernel_size=12,
    final_act_fn=None, final_bias=False)
BWE_STAGE_DEFAULTS: dict[str, Any] = dict(
    hidden_channels=512, upsample_kernel_sizes=[12, 11, 4, 4, 4], upsample_factors=[6, 5, 2, 2, 2])
STFT_DEFAULTS: dict[str, Any] = dict(filter_length=512, hop_length=80, window_length=512, num_mel_channels=64,
                                     input_sampling_rate=16000, output_sampling_rate=48000)


class BandwidthExtendedVocoder(nn.Module):
    """Mel -> 16 kHz generator -> mel again -> 48 kHz detail, plus the resampled 16 kHz wave
    (diffusers' ``LTX2VocoderWithBWE`` keys)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        data = {k: v for k, v in config.items() if not k.startswith("_")}
        unknown = sorted(k for k in data if k not in BWE_DEFAULTS and k not in STFT_DEFAULTS
                         and not (k.startswith("bwe_") and k[4:] in BWE_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown LTX2VocoderWithBWE config keys: {unknown}")
        stft = {k: data.get(k, v) for k, v in STFT_DEFAULTS.items()}
        first = {k: data.get(k, v) for k, v in BWE_DEFAULTS.items()}
        second = {k: data.get(f"bwe_{k}", BWE_STAGE_DEFAULTS.get(k, v)) for k, v in BWE_DEFAULTS.items()}
        self.hop, self.rate_in, self.rate_out = stft["hop_length"], stft["input_sampling_rate"], \
            stft["output_sampling_rate"]
        self.vocoder = Generator({**first, "output_sampling_rate": self.rate_in})
        self.bwe_generator = Generator({**second, "output_sampling_rate": self.rate_out})
        self.mel_stft = MelStft(stft["filter_length"], self.hop, stft["window_length"], stft["num_mel_channels"])
        self.resampler = Upsample1d(self.rate_out // self.rate_in, window="hann", persistent=False)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel ``[B, C, frames, bins]`` -> waveform ``[B, C, samples]`` at ``sampling_rate``."""
        wave = self.vocoder(mel)
        b, channels, samples = wave.shape
        if samples % self.hop:
            wave = F.pad(wave, (0, self.hop - samples % self.hop))
        remel = self.mel_stft(wave.flatten(0, 1)).unflatten(0, (b, channels))
        detail = self.bwe_generator(remel.transpose(2, 3))
        out = torch.clamp(detail + self.resampler(wave), -1, 1)
        return out[..., :samples * self.rate_out // self.rate_in]

    @property
    def sampling_rate(self) -> int:
        return self.rate_out


def build_vocoder(config: Mapping[str, Any]) -> nn.Module:
    """The vocoder a ``vocoder/config.json`` describes (its ``_class_name`` picks the layout)."""
    kind = config.get("_class_name", "LTX2Vocoder")
    if kind == "LTX2VocoderWithBWE":
        return BandwidthExtendedVocoder(config)
    if kind == "LTX2Vocoder":
        return Generator(config)
    raise ValueError(f"vocoder config: _class_name {kind!r} is not supported")
