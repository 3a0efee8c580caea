"""The neural-source-filter (NSF) excitation: a sine at F0 and its overtones, merged into one
harmonic source signal that the vocoder's filter shapes.

``SineGen`` follows the hn-NSF recipe as StyleTTS2/Kokoro and HiFT use it:

- per harmonic ``k`` (``k = 1 .. harmonic_num + 1``) the phase increment per sample is
  ``(k * f0 / sampling_rate) mod 1``; every harmonic but the fundamental starts at a random
  initial phase;
- the increments are averaged down by ``upsample_scale`` (linear interpolation), summed, and
  the phase is interpolated back up (times ``upsample_scale``): the running sum is taken on the
  frame grid, so the phase is smooth where F0 steps between frames;
- voiced samples (``f0 > voiced_threshold``) carry ``sine_amp * sin(phase)`` plus Gaussian
  noise of std ``noise_std``; unvoiced samples carry noise of std ``sine_amp / 3`` only.

Randomness is explicit: ``noise=False`` gives the deterministic source (no initial phases, no
noise); otherwise the draws come from ``generator`` (or torch's global generator when it is
``None``) in the reference's order and layout (initial phases ``rand(B, H + 1)``, then the noise
filled into a ``[B, H + 1, L]`` buffer viewed as ``[B, L, H + 1]``), so the same seed gives the reference's values.

The causal variant (CosyVoice3's streaming HiFT) differs in two places: the phase goes back
up to the sample rate by repeating each frame's value (``causal=True``; linear interpolation
would read half a frame ahead), and the noise comes from a caller-given ``noise_table``
indexed by sample position, so a prefix of the signal gets the same noise however long the
call is.

``SampleSineGen`` is the older recipe that CosyVoice1's HiFT and Chatterbox's S3Gen vocoder
use: the phase is summed per sample (``2 pi * (cumsum(k * f0 / sampling_rate) mod 1)``), each
overtone gets a uniform initial phase in ``[-pi, pi)`` that does reach the output, and the noise
is drawn in the harmonic-major ``[B, H + 1, L]`` layout.

Note (``SineGen``): the initial phases are added at sample 0 only, and the linear downsampling never reads
sample 0 (frame ``j`` interpolates samples ``scale * j + scale / 2 - 1`` and the next), so in the
reference as here they do not reach the output; they are still drawn, to keep the sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HarmonicSource", "SampleSineGen", "SineGen"]


class SineGen(nn.Module):
    """F0 ``[B, L, 1]`` at the sample rate -> sines ``[B, L, harmonic_num + 1]`` and the
    voiced mask ``[B, L, 1]``."""

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        harmonic_num: int = 0,
        sine_amp: float = 0.1,
        noise_std: float = 0.003,
        voiced_threshold: float = 0.0,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.harmonic_num = harmonic_num
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold

    def forward(
        self,
        f0: torch.Tensor,
        *,
        noise: bool = True,
        generator: torch.Generator | None = None,
        noise_table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``noise_table`` (``[1 or B, >= L, harmonic_num + 1]``) replaces the random draws: its
        first ``L`` samples are the noise, and no initial phases are drawn (they would not
        reach the output, see the module note)."""
        batch, _, _ = f0.shape
        harmonics = torch.arange(1, self.harmonic_num + 2, device=f0.device, dtype=f0.dtype)
        increments = (f0 * harmonics / self.sampling_rate) % 1  # [B, L, H+1], cycles per sample
        if noise and noise_table is None:
            start = torch.rand(batch, self.harmonic_num + 1, generator=generator, device=f0.device, dtype=f0.dtype)
            start[:, 0] = 0  # the fundamental starts at phase 0
            increments = torch.cat([increments[:, :1] + start[:, None], increments[:, 1:]], dim=1)
        scale = self.upsample_scale
        per_frame = F.interpolate(increments.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(per_frame, dim=1) * 2 * torch.pi
        up_mode = "nearest" if self.causal else "linear"
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=scale, mode=up_mode).transpose(1, 2)
        sines = torch.sin(phase) * self.sine_amp
        voiced = (f0 > self.voiced_threshold).to(sines.dtype)
        if not noise:
            return sines * voiced, voiced
        amplitude = voiced * self.noise_std + (1 - voiced) * (self.sine_amp / 3)
        if noise_table is not None:
            return sines * voiced + amplitude * noise_table[:, : sines.shape[1]].to(sines), voiced
        # The reference's randn_like fills its sines' (transposed, harmonic-major) layout, and
        # torch draws a strided tensor element by element (a contiguous one in vectorised
        # blocks, a different sequence): fill the same layout.
        b, length, harmonics = sines.shape
        draws = torch.empty(b, harmonics, length, device=sines.device, dtype=sines.dtype).transpose(1, 2)
        draws.normal_(generator=generator)
        return sines * voiced + amplitude * draws, voiced


class SampleSineGen(nn.Module):
    """``SineGen``'s interface, the phase summed per sample (CosyVoice1, Chatterbox)."""

    def __init__(
        self,
        sampling_rate: int,
        harmonic_num: int = 0,
        sine_amp: float = 0.1,
        noise_std: float = 0.003,
        voiced_threshold: float = 0.0,
    ) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.harmonic_num = harmonic_num
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold

    def forward(
        self,
        f0: torch.Tensor,
        *,
        noise: bool = True,
        generator: torch.Generator | None = None,
        noise_table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if noise_table is not None:
            raise ValueError("the per-sample sine source has no position-indexed noise (a causal HiFT uses SineGen)")
        f0 = f0.transpose(1, 2)  # [B, 1, L]: the reference's harmonic-major layout, for its draws
        harmonics = torch.arange(1, self.harmonic_num + 2, device=f0.device, dtype=f0.dtype)[:, None]
        phase = 2 * torch.pi * (torch.cumsum(f0 * harmonics / self.sampling_rate, dim=-1) % 1)  # [B, H+1, L]
        if noise:
            start = torch.rand(f0.shape[0], self.harmonic_num + 1, 1, generator=generator, device=f0.device,
                               dtype=f0.dtype)
            start = -torch.pi + start * (2 * torch.pi)
            start[:, 0] = 0  # the fundamental starts at phase 0
            phase = phase + start
        sines = torch.sin(phase) * self.sine_amp
        voiced = (f0 > self.voiced_threshold).to(sines.dtype)
        out = sines * voiced
        if noise:
            amplitude = voiced * self.noise_std + (1 - voiced) * (self.sine_amp / 3)
            out = out + amplitude * torch.randn(sines.shape, generator=generator, device=f0.device, dtype=f0.dtype)
        return out.transpose(1, 2), voiced.transpose(1, 2)


class HarmonicSource(nn.Module):
    """The hn-NSF source module: ``tanh(l_linear(sines))``, one excitation channel from the
    harmonics (``l_linear`` is the checkpoint's name). F0 ``[B, L, 1]`` -> ``[B, L, 1]``.
    ``per_sample`` picks ``SampleSineGen`` (CosyVoice1, Chatterbox) over ``SineGen``."""

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        harmonic_num: int = 0,
        sine_amp: float = 0.1,
        noise_std: float = 0.003,
        voiced_threshold: float = 0.0,
        causal: bool = False,
        per_sample: bool = False,
    ) -> None:
        super().__init__()
        if per_sample and causal:
            raise ValueError("the per-sample sine source has no causal variant")
        self.l_sin_gen: nn.Module = (
            SampleSineGen(sampling_rate, harmonic_num, sine_amp, noise_std, voiced_threshold)
            if per_sample
            else SineGen(sampling_rate, upsample_scale, harmonic_num, sine_amp, noise_std, voiced_threshold, causal)
        )
        self.l_linear = nn.Linear(harmonic_num + 1, 1)

    def forward(
        self,
        f0: torch.Tensor,
        *,
        noise: bool = True,
        generator: torch.Generator | None = None,
        noise_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sines, _ = self.l_sin_gen(f0, noise=noise, generator=generator, noise_table=noise_table)
        return torch.tanh(self.l_linear(sines))
