"""PerTh ("perceptual threshold"), Resemble AI's neural audio watermark, as Chatterbox applies it
to every synthesised clip (``resemble-perth``'s ``PerthImplicitWatermarker``, whose wheel
ships the trained network).

The watermark lives in the magnitude spectrogram at 32 kHz:

- **analysis**: an STFT (2048-point Hann window and FFT, hop 320, centred with reflection
  padding) split into phase and magnitude; the magnitude goes to decibels (floored at
  ``stft_magnitude_min``, 1e-9, i.e. -180 dB) and is scaled so that -180 dB is 0 and +15 dB
  is 1;
- **embedding** (``PerthEncoder``): a stack of 1-D convolutions over frames (1x1 in, five
  kernel-7 layers, 1x1 out, leaky ReLU between) reads the lowest ``subband`` bins (up to
  ``max_wmark_freq``, 2 kHz: 128 bins) and adds its output to them as a residual, except in
  silent frames (``loud_frames``: the frame's summed scaled magnitude at most 5 % of the
  loudest frame's; on a scale where -180 dB is 0, that spares digital silence, not quiet
  speech);
- **synthesis**: the scaled magnitude back to linear (the exponent capped at 10^10) with the
  original phase, inverse STFT; the clip comes back ``(frames - 1) * hop`` samples long,
  the input length rounded down to a whole hop.

The detector (``PerthDecoder``) reads the same sub-band at three speeds (the frames linearly
resampled to 1.25x, 1x and 0.75x their count), each through its own convolution stack with two
output rows (a score and a logit), averages each row over the loud frames, and weighs the three
scores by the softmax of the three logits: about 1 for a marked clip, about 0 for a clean one.

Other sample rates (S3Gen's 24 kHz): the reference resamples to 32 kHz and back with librosa's
default (soxr "HQ") to mark, and with scipy's polyphase filter to detect. ``PerthWatermarker``
takes both as arguments with those defaults (``resample.py``); soxr is a package M* does not
depend on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.perth.resample import polyphase_resample, soxr_resample
from mstar.model.weights import load_weights

__all__ = ["PerthConfig", "PerthDecoder", "PerthEncoder", "PerthNet", "PerthWatermarker", "load_perth",
           "loud_frames", "perth_name_map"]

Resample = Callable[[torch.Tensor, int, int], torch.Tensor]
"""``resample(wave [samples], from_rate, to_rate) -> wave``."""


@dataclass(frozen=True)
class PerthConfig:
    """The shipped network's ``hparams.yaml`` (the training-only keys left out)."""

    sample_rate: int = 32000
    n_fft: int = 2048
    hop: int = 320
    hidden: int = 256
    max_wmark_freq: float = 2000.0
    magnitude_floor: float = 1e-9  # ``stft_magnitude_min``
    headroom_db: float = 15.0

    @property
    def subband(self) -> int:
        """Frequency bins the watermark uses: those up to ``max_wmark_freq``."""
        bins = self.n_fft // 2 + 1
        return int(round(bins * self.max_wmark_freq / (self.sample_rate / 2)))

    @property
    def floor_db(self) -> float:
        return 20 * math.log10(self.magnitude_floor)


class _Conv(nn.Module):
    """A same-length conv, leaky ReLU after (``act``); ``conv`` is the checkpoint's name."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, act: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels_in, channels_out, kernel, padding=(kernel - 1) // 2)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return F.leaky_relu(x) if self.act else x


def _stack(channels_in: int, hidden: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(_Conv(channels_in, hidden, 1), *(_Conv(hidden, hidden, 7) for _ in range(5)),
                         _Conv(hidden, channels_out, 1, act=False))


def loud_frames(magnitude: torch.Tensor, fraction: float = 0.05) -> torch.Tensor:
    """``[B, 1, T]`` float: 1 where a frame's summed scaled magnitude ``[B, bins, T]`` exceeds
    ``fraction`` of the loudest frame's (0 in digital silence, 1 almost everywhere else)."""
    energy = magnitude.sum(dim=1)
    return (energy > fraction * energy.max(dim=1).values[:, None]).float()[:, None]


class PerthEncoder(nn.Module):
    """Scaled magnitude ``[B, bins, T]`` -> the same with the watermark added to its sub-band."""

    def __init__(self, config: PerthConfig) -> None:
        super().__init__()
        self.subband = config.subband
        self.layers = _stack(self.subband, config.hidden, self.subband)

    def forward(self, magnitude: torch.Tensor) -> torch.Tensor:
        residual = self.layers(magnitude[:, : self.subband]) * loud_frames(magnitude)
        return torch.cat([magnitude[:, : self.subband] + residual, magnitude[:, self.subband:]], dim=1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(dim=2) / mask.sum(dim=2)


class PerthDecoder(nn.Module):
    """Scaled magnitude ``[B, bins, T]`` -> watermark score ``[B]`` (1: marked, 0: clean)."""

    speeds = (("slow_layers", 1.25), ("normal_layers", 1.0), ("fast_layers", 0.75))

    def __init__(self, config: PerthConfig) -> None:
        super().__init__()
        self.subband = config.subband
        for name, _ in self.speeds:
            self.add_module(name, _stack(self.subband, config.hidden, 2))

    def forward(self, magnitude: torch.Tensor) -> torch.Tensor:
        mask = loud_frames(magnitude)
        band = magnitude[:, : self.subband]
        frames = band.shape[-1]
        scores, logits = [], []
        for name, speed in self.speeds:
            x = band if speed == 1.0 else F.interpolate(band, size=int(frames * speed), mode="linear",
                                                        align_corners=True)
            out = getattr(self, name)(x)
            m = F.interpolate(mask, size=out.shape[-1], mode="nearest")
            logits.append(_masked_mean(out[:, :1], m))
            scores.append(_masked_mean(out[:, 1:], m))
        weights = torch.softmax(torch.cat(logits, dim=1), dim=1)
        return (torch.cat(scores, dim=1) * weights).sum(dim=1)


class PerthNet(nn.Module):
    """The embedder and the detector, with the spectral analysis and synthesis around them."""

    def __init__(self, config: PerthConfig = PerthConfig()) -> None:
        super().__init__()
        self.config = config
        self.encoder = PerthEncoder(config)
        self.decoder = PerthDecoder(config)

    def _window(self, like: torch.Tensor) -> torch.Tensor:
        return torch.hann_window(self.config.n_fft, device=like.device, dtype=like.dtype)

    def analyse(self, wave: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Wave ``[..., samples]`` at ``sample_rate`` -> (scaled magnitude, phase), each ``[...,
        bins, frames]``."""
        c = self.config
        spec = torch.stft(wave, c.n_fft, hop_length=c.hop, win_length=c.n_fft, window=self._window(wave),
                          center=True, pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
        db = 20 * torch.log10(spec.abs().clip(c.magnitude_floor))
        return (db - c.floor_db) / (-c.floor_db + c.headroom_db), torch.angle(spec)

    def synthesise(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """The inverse of ``analyse``: ``(frames - 1) * hop`` samples."""
        c = self.config
        db = magnitude * (-c.floor_db + c.headroom_db) + c.floor_db
        spec = 10.0 ** (db / 20).clip(max=10) * torch.exp(1j * phase)
        return torch.istft(spec, c.n_fft, hop_length=c.hop, win_length=c.n_fft, window=self._window(magnitude),
                           center=True, normalized=False, onesided=True)

    def embed(self, wave: torch.Tensor) -> torch.Tensor:
        """Mark one clip ``[samples]`` at ``sample_rate``."""
        magnitude, phase = self.analyse(wave.float())
        return self.synthesise(self.encoder(magnitude[None])[0], phase)

    def detect(self, wave: torch.Tensor) -> torch.Tensor:
        """The watermark score of one clip ``[samples]``, clipped to [0, 1] (a 0-d tensor)."""
        magnitude, _ = self.analyse(wave.float())
        return self.decoder(magnitude[None])[0].clip(0.0, 1.0)


@dataclass
class PerthWatermarker:
    """``apply(wave, sample_rate)`` marks a clip as the reference's ``apply_watermark`` does;
    ``score(wave, sample_rate)`` is its ``get_watermark(..., round=False)``. Clips at another
    rate than the network's are resampled: by ``resample`` to the network's rate and back when
    marking, by ``detect_resample`` when scoring (the reference's choices by default)."""

    net: PerthNet
    resample: Resample = soxr_resample
    detect_resample: Resample = polyphase_resample

    @torch.no_grad()
    def apply(self, wave: torch.Tensor, sample_rate: int) -> torch.Tensor:
        rate = self.net.config.sample_rate
        if sample_rate == rate:
            return self.net.embed(wave)
        return self.resample(self.net.embed(self.resample(wave, sample_rate, rate)), rate, sample_rate)

    @torch.no_grad()
    def score(self, wave: torch.Tensor, sample_rate: int) -> torch.Tensor:
        rate = self.net.config.sample_rate
        return self.net.detect(wave if sample_rate == rate else self.detect_resample(wave, sample_rate, rate))


def perth_name_map(name: str) -> str | None:
    """The shipped checkpoint's names are ours, but for its STFT modules' cached windows
    (``ap.``), which ``PerthNet`` computes instead."""
    return None if name.startswith("ap.") else name


def load_perth(net: PerthNet, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill ``net`` from the checkpoint's ``model`` state dict (``perth_net_250000.pth.tar``),
    strict both ways."""
    load_weights(net, named_tensors, name_map=perth_name_map)
