"""Helpers of the vocoder and TTS parity tests: the error of a waveform relative to the
reference's peak, weights moved off their initial values, an F0 track with unvoiced stretches."""

from __future__ import annotations

import torch


def peak_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference over the reference's largest magnitude."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def perturbed(module: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> torch.nn.Module:
    """``module`` in eval mode with every parameter moved off its initial value (norm affines,
    weight-norm magnitudes, Snake alphas and biases included), so no term of the maths is
    trivially 1 or 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return module.eval()


def random_f0(batch: int, frames: int, seed: int = 3) -> torch.Tensor:
    """F0 per frame in Hz, with unvoiced (0 Hz and below-threshold) stretches."""
    g = torch.Generator().manual_seed(seed)
    f0 = 80 + 220 * torch.rand(batch, frames, generator=g)
    f0[:, : frames // 5] = 0.0
    f0[:, -2:] = 5.0  # below the 10 Hz voicing threshold of the tests' sources
    return f0
