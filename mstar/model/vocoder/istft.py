"""The iSTFT head of iSTFTNet/HiFT vocoders, and the matching forward STFT of the source.

The generator predicts a log-magnitude and a phase per frequency bin of an ``n_fft``-point
STFT with hop ``hop_length`` (Hann window of ``n_fft`` samples, centred frames), and the
waveform is their inverse STFT; the harmonic source enters the generator as its own
magnitude and phase on the same grid (Kokoro), or as its real and imaginary parts (HiFT,
``analyse_complex``). The window is a non-persistent buffer: checkpoints do not carry it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ISTFT"]


class ISTFT(nn.Module):
    def __init__(self, n_fft: int, hop_length: int) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.register_buffer("window", torch.hann_window(n_fft, periodic=True), persistent=False)

    @property
    def bins(self) -> int:
        return self.n_fft // 2 + 1

    def analyse(self, signal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, L]`` -> magnitude and phase ``[B, bins, frames]``."""
        spec = torch.stft(
            signal, self.n_fft, self.hop_length, self.n_fft, window=self.window.to(signal.dtype),
            return_complex=True,
        )
        return spec.abs(), spec.angle()

    def analyse_complex(self, signal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, L]`` -> real and imaginary parts ``[B, bins, frames]`` (HiFT's source features)."""
        spec = torch.stft(
            signal, self.n_fft, self.hop_length, self.n_fft, window=self.window.to(signal.dtype),
            return_complex=True,
        )
        return spec.real, spec.imag

    def synthesise(
        self, magnitude: torch.Tensor, phase: torch.Tensor, *, max_magnitude: float | None = None
    ) -> torch.Tensor:
        """Magnitude and phase ``[B, bins, frames]`` -> waveform ``[B, 1, L]``; HiFT caps the
        magnitude at ``max_magnitude`` (its ``exp`` can overflow on untrained or odd input)."""
        if max_magnitude is not None:
            magnitude = magnitude.clamp(max=max_magnitude)
        spec = magnitude * torch.exp(phase * 1j)
        wave = torch.istft(spec, self.n_fft, self.hop_length, self.n_fft, window=self.window.to(magnitude.dtype))
        return wave.unsqueeze(1)
