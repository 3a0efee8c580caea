"""The iSTFT head of iSTFTNet/HiFT vocoders, and the matching forward STFT of the source.

The generator predicts a log-magnitude and a phase per frequency bin of an ``n_fft``-point
STFT with hop ``hop_length`` (Hann window of ``n_fft`` samples, centred frames), and the
waveform is their inverse STFT; the harmonic source enters the generator as its own
magnitude and phase on the same grid (Kokoro), or as its real and imaginary parts (HiFT,
``analyse_complex``). The window is a non-persistent buffer: checkpoints do not carry it.

``analyse_rows`` / ``synthesise_rows`` do the same for a batch of rows padded to one length:
each row is reflected at its own end (as a solo STFT reflects it), frames past a row's last
are zeroed, and the iSTFT divides each row by its own window envelope (the overlap of its
valid frames only), so a row's result does not depend on the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ISTFT", "prefix_mask"]


class ISTFT(nn.Module):
    def __init__(self, n_fft: int, hop_length: int) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.hop_length = hop_length
        # computed in float32 whatever the default dtype (made in bf16 it differs in the last
        # bit), then held in the module's dtype, as a cast of a float32 build holds it
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float32)
        self.register_buffer("window", window.to(torch.get_default_dtype()), persistent=False)

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

    def analyse_rows(self, signal: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``analyse`` of padded rows: ``signal`` ``[B, L]``, ``lengths`` ``[B]`` valid samples
        (multiples of the hop) -> magnitude and phase ``[B, bins, L // hop + 1]``, zero past a
        row's ``length // hop + 1`` frames."""
        half = self.n_fft // 2
        length = signal.shape[1]
        t = torch.arange(-half, length + half, device=signal.device).abs()[None]  # left: reflect
        last = lengths[:, None] - 1
        index = torch.where(t > last, 2 * last - t, t).clamp(0, length - 1)  # right: reflect at the row's end
        spec = torch.stft(
            signal.gather(1, index), self.n_fft, self.hop_length, self.n_fft,
            window=self.window.to(signal.dtype), center=False, return_complex=True,
        )
        keep = prefix_mask(lengths // self.hop_length + 1, spec.shape[-1])[:, None]
        return spec.abs() * keep, spec.angle() * keep

    def synthesise_rows(self, magnitude: torch.Tensor, phase: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``synthesise`` of padded rows: ``keep`` ``[B, frames]`` marks each row's valid frames
        (a prefix) -> ``[B, 1, hop * (frames - 1)]``; row ``i`` is valid for
        ``hop * (valid frames - 1)`` samples."""
        frames = magnitude.shape[-1]
        keep = keep[:, None].to(magnitude.dtype)
        spec = torch.polar(magnitude * keep, phase * keep)
        window = self.window.to(magnitude.dtype)[None, :, None]
        chunks = torch.fft.irfft(spec, n=self.n_fft, dim=1) * window  # [B, n_fft, frames]
        total = self.n_fft + self.hop_length * (frames - 1)
        wave = _overlap_add(chunks, total, self.n_fft, self.hop_length)
        envelope = _overlap_add((window**2) * keep, total, self.n_fft, self.hop_length)
        wave = torch.where(envelope > 1e-11, wave / envelope.clamp(min=1e-11), 0.0)
        half = self.n_fft // 2
        return wave[:, None, half : total - half]


def _overlap_add(chunks: torch.Tensor, total: int, n_fft: int, hop: int) -> torch.Tensor:
    """Frames ``[B, n_fft, frames]`` summed at hop ``hop`` -> ``[B, total]``."""
    out = F.fold(chunks, (1, total), (1, n_fft), stride=(1, hop))
    return out.reshape(chunks.shape[0], total)


def prefix_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, size]``: true at the first ``lengths[b]`` positions of row ``b``."""
    return torch.arange(size, device=lengths.device)[None] < lengths[:, None]
