"""Cosmos3's sound tokenizer (the AVAE): 48 kHz stereo waveforms <-> sound latents
``[sound_dim, T]`` at ``sampling_rate / hop_size`` latents a second (25 for the released one).

The maths of diffusers' ``Cosmos3AVAEAudioTokenizer`` (0.42.1), with its parameter names, so the
released ``sound_tokenizer/`` weights load after their weight-norm pairs are folded
(``mstar.model.vocoder.weight_norm``):

- **Encoder** (SpecConvNeXt): each channel's short-time Fourier transform (Hann window of
  ``enc_n_fft``, hop ``enc_hop_length``, the signal padded by ``(n_fft - hop) / 2`` each side,
  no centring), the real parts of the bins then the imaginary parts, the channels stacked; a
  1x1 convolution, then per stage ``enc_num_blocks`` ConvNeXt blocks (depthwise 7-tap conv,
  a bias-free layer norm in float32, 1x1 up by four, SnakeBeta, 1x1 down, residual) and a
  strided convolution (kernel ``2 s``, padding ``ceil(s / 2)``); a last 1x1 convolution gives
  ``enc_latent_dim`` channels: the posterior's mean and scale halves (``std = softplus(scale)
  + 1e-4``). ``encode`` first scales the waveform to a 0.95 peak (``normalize_volume``, the peak
  of the whole batch, as the reference) and right-pads it to a multiple of the hop.
- **Decoder** (Oobleck): a 7-tap convolution up to ``dec_dim * dec_c_mults[-1]`` channels, per
  stride (``dec_strides`` reversed) SnakeBeta, a transposed convolution (kernel ``2 s``, padding
  ``ceil(s / 2)``, output padding ``s % 2``) and three residual units (SnakeBeta, 7-tap
  convolution at dilation 1, 3, 9, SnakeBeta, 1x1, residual); SnakeBeta and a bias-free 7-tap
  convolution to ``dec_out_channels``; clamped to ``[-1, 1]``.

SnakeBeta is ``x + sin(e^alpha x)^2 / (e^beta + 1e-9)`` per channel. A checkpoint without
``encoder.*`` tensors is decoder-only (as diffusers disables its encoder on such a load): build
with ``encoder=False``; serving only decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.hf_config import DiffusersConfig

__all__ = ["Cosmos3SoundTokenizer", "SoundTokenizerConfig"]


@dataclass
class SoundTokenizerConfig(DiffusersConfig):
    """``sound_tokenizer/config.json``; names and defaults as the diffusers constructor's. Only
    the released variant is served: any other setting of the fixed fields is refused."""

    diffusers_class = "Cosmos3AVAEAudioTokenizer"

    model_type: str = "autoencoder_v2"
    sampling_rate: int = 48000
    vocoder_input_dim: int = 64  # latent channels (the tower's sound_dim)
    dec_dim: int = 320
    dec_c_mults: tuple[int, ...] = (1, 2, 4, 8, 16)
    dec_strides: tuple[int, ...] = (2, 4, 5, 6, 8)
    dec_out_channels: int = 2
    stereo: bool = True
    use_wav_as_input: bool = True
    normalize_volume: bool = True
    hop_size: int | None = None  # waveform samples per latent; None: prod(dec_strides)
    input_channels: int = 1
    enc_type: str = "spec_convnext"
    enc_dim: int = 192
    enc_intermediate_dim: int = 768  # unused (ConvNeXt blocks widen by four), as the reference
    enc_num_layers: int = 12  # unused, as the reference
    enc_num_blocks: int = 2
    enc_n_fft: int = 64
    enc_hop_length: int = 16
    enc_latent_dim: int = 128
    enc_c_mults: tuple[int, ...] = (1, 2, 4)
    enc_strides: tuple[int, ...] = (4, 5, 6)
    enc_identity_init: bool = False  # a training-time init; weights come from the checkpoint
    enc_use_snake: bool = True
    dec_type: str = "oobleck"
    dec_use_snake: bool = True
    dec_final_tanh: bool = False
    dec_anti_aliasing: bool = False
    dec_use_nearest_upsample: bool = False
    dec_use_tanh_at_final: bool = False
    bottleneck_type: str = "vae"
    bottleneck: dict | None = None
    activation: str = "snakebeta"
    snake_logscale: bool = True
    anti_aliasing: bool = False
    use_cuda_kernel: bool = False
    causal: bool = False
    padding_mode: str = "zeros"
    latent_mean: float | list[float] | None = None
    latent_std: float | list[float] | None = None
    encoder_enabled: bool = True

    _FIXED = {"model_type": "autoencoder_v2", "use_wav_as_input": True, "enc_type": "spec_convnext",
              "dec_type": "oobleck", "dec_use_snake": True, "dec_final_tanh": False, "dec_anti_aliasing": False,
              "dec_use_nearest_upsample": False, "dec_use_tanh_at_final": False, "bottleneck_type": "vae",
              "activation": "snakebeta", "snake_logscale": True, "anti_aliasing": False, "use_cuda_kernel": False,
              "causal": False, "latent_mean": None, "latent_std": None}

    def __post_init__(self) -> None:
        for name, want in self._FIXED.items():
            if getattr(self, name) != want:
                raise ValueError(f"sound_tokenizer config: {name}={getattr(self, name)!r} is not supported "
                                 f"(the released AVAE has {want!r})")
        if self.bottleneck is not None and self.bottleneck.get("type", "vae") != "vae":
            raise ValueError("sound_tokenizer config: bottleneck.type must be 'vae'")
        self.dec_c_mults, self.dec_strides = tuple(self.dec_c_mults), tuple(self.dec_strides)
        self.enc_c_mults, self.enc_strides = tuple(self.enc_c_mults), tuple(self.enc_strides)
        if len(self.dec_c_mults) != len(self.dec_strides):
            raise ValueError("sound_tokenizer config: dec_c_mults and dec_strides must have the same length")
        if len(self.enc_c_mults) != len(self.enc_strides):
            raise ValueError("sound_tokenizer config: enc_c_mults and enc_strides must have the same length")
        if self.enc_latent_dim != 2 * self.vocoder_input_dim:
            raise ValueError(f"sound_tokenizer config: enc_latent_dim {self.enc_latent_dim} must be twice "
                             f"vocoder_input_dim {self.vocoder_input_dim} (the posterior's mean and scale)")

    @property
    def hop(self) -> int:
        return int(self.hop_size) if self.hop_size is not None else math.prod(self.dec_strides)

    def latent_frames(self, samples: int) -> int:
        """Latents covering ``samples`` waveform samples (rounded up)."""
        return -(-samples // self.hop)


class SnakeBeta(nn.Module):
    """``x + sin(e^alpha x)^2 / (e^beta + 1e-9)``, ``alpha`` and ``beta`` ``[1, C, 1]`` logs."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.beta.exp() + 1e-9).reciprocal() * torch.sin(self.alpha.exp() * x).pow(2)


def strided_conv(cin: int, cout: int, stride: int, padding_mode: str = "zeros") -> nn.Conv1d:
    return nn.Conv1d(cin, cout, 2 * stride, stride=stride, padding=math.ceil(stride / 2), padding_mode=padding_mode)


# ---------------------------------------------------------------------- encoder
class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, snake: bool) -> None:
        super().__init__()
        self.dwconv = nn.Sequential(nn.ConstantPad1d((3, 3), 0.0), nn.Conv1d(dim, dim, 7, groups=dim))
        self.norm = nn.LayerNorm(dim, eps=1e-5, bias=False)
        self.pwconv1 = nn.Conv1d(dim, 4 * dim, 1)
        self.act = SnakeBeta(4 * dim) if snake else nn.GELU()
        self.pwconv2 = nn.Conv1d(4 * dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = F.layer_norm(h.float(), h.shape[-1:], self.norm.weight.float(), None, self.norm.eps).to(h.dtype)
        return x + self.pwconv2(self.act(self.pwconv1(h.transpose(1, 2))))


class SpecConvNeXtEncoder(nn.Module):
    def __init__(self, c: SoundTokenizerConfig) -> None:
        super().__init__()
        self.channels = c.input_channels * (2 if c.stereo else 1)
        self.n_fft, self.hop = c.enc_n_fft, c.enc_hop_length
        widths = [m * c.enc_dim for m in c.enc_c_mults]
        layers: list[nn.Module] = [nn.Conv1d((c.enc_n_fft + 2) * self.channels, widths[0], 1, bias=False)]
        for i, stride in enumerate(c.enc_strides):
            layers += [ConvNeXtBlock(widths[i], c.enc_use_snake) for _ in range(c.enc_num_blocks)]
            layers.append(strided_conv(widths[i], widths[min(i + 1, len(widths) - 1)], stride, c.padding_mode))
        layers.append(nn.Conv1d(widths[-1], c.enc_latent_dim, 1, bias=False))
        self.layers = nn.Sequential(*layers)

    def spectrogram(self, audio: torch.Tensor) -> torch.Tensor:
        """``[B, C, N]`` -> ``[B, C * (n_fft + 2), frames]``: per channel the bins' real parts,
        then their imaginary parts."""
        b, c, n = audio.shape
        pad = self.n_fft - self.hop
        x = F.pad(audio.reshape(b * c, n), (pad // 2, pad - pad // 2)).float()
        window = torch.hann_window(self.n_fft, device=x.device, dtype=x.dtype)
        spec = torch.stft(x, self.n_fft, self.hop, self.n_fft, window, center=False, return_complex=True)
        spec = torch.cat([spec.real, spec.imag], dim=1).to(audio.dtype)
        return spec.reshape(b, c * spec.shape[1], spec.shape[2])

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        if audio.shape[1] != self.channels:
            raise ValueError(f"the sound encoder takes {self.channels} audio channels, got {audio.shape[1]}")
        return self.layers(self.spectrogram(audio))


# ---------------------------------------------------------------------- decoder
class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = SnakeBeta(dim)
        self.conv1 = nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = SnakeBeta(dim)
        self.conv2 = nn.Conv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.snake1 = SnakeBeta(cin)
        self.conv_t1 = nn.ConvTranspose1d(cin, cout, 2 * stride, stride=stride, padding=math.ceil(stride / 2),
                                          output_padding=stride % 2)
        self.res_unit1 = ResidualUnit(cout, 1)
        self.res_unit2 = ResidualUnit(cout, 3)
        self.res_unit3 = ResidualUnit(cout, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_unit3(self.res_unit2(self.res_unit1(self.conv_t1(self.snake1(x)))))


class OobleckDecoder(nn.Module):
    def __init__(self, c: SoundTokenizerConfig) -> None:
        super().__init__()
        widths = [c.dec_dim * m for m in (1, *c.dec_c_mults)]  # widths[k]: after the k-th stride from the end
        strides = list(reversed(c.dec_strides))
        self.conv1 = nn.Conv1d(c.vocoder_input_dim, widths[-1], 7, padding=3)
        n = len(strides)
        self.block = nn.ModuleList(DecoderBlock(widths[n - i], widths[n - i - 1], s) for i, s in enumerate(strides))
        self.snake1 = SnakeBeta(c.dec_dim)
        self.conv2 = nn.Conv1d(c.dec_dim, c.dec_out_channels, 7, padding=3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class Cosmos3SoundTokenizer(nn.Module):
    def __init__(self, config: SoundTokenizerConfig, encoder: bool = True) -> None:
        super().__init__()
        self.config = config
        self.encoder = SpecConvNeXtEncoder(config) if encoder and config.encoder_enabled else None
        self.decoder = OobleckDecoder(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv1.weight.dtype

    def moments(self, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The posterior of waveforms ``[B, C, N]`` (in [-1, 1]): its mean and standard deviation,
        each ``[B, vocoder_input_dim, ceil(N / hop)]``."""
        if self.encoder is None:
            raise ValueError("this sound tokenizer was loaded decoder-only (no encoder.* weights): it cannot encode")
        if audio.ndim != 3:
            raise ValueError(f"audio must be [B, C, N], got {tuple(audio.shape)}")
        if self.config.normalize_volume:
            audio = audio / (audio.abs().max() + 1e-5) * 0.95
        audio = F.pad(audio, (0, -audio.shape[-1] % self.config.hop))
        mean, scale = self.encoder(audio.to(self.dtype)).chunk(2, dim=1)
        return mean, F.softplus(scale) + 1e-4

    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """Waveforms ``[B, C, N]`` -> latents ``[B, vocoder_input_dim, ceil(N / hop)]`` (the
        posterior's mean)."""
        return self.moments(audio)[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, vocoder_input_dim, T]`` -> waveforms ``[B, dec_out_channels, ~T * hop]``
        in [-1, 1]."""
        return self.decoder(latents.to(self.dtype)).clamp(-1.0, 1.0)
