"""A Piper voice as one PyTorch module: VITS inference from phoneme ids to audio.

``PiperVits.forward`` takes a padded batch of phoneme-id rows and per-row scales and noise,
and returns per-row audio and its length. Randomness enters only through the noise tensors the
caller passes (``PiperNoise``), drawn per row from that row's own generator, so a seeded row's
audio does not depend on what it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.model.piper.config import PiperArch
from mstar.model.piper.decoder import Generator, ResidualCouplingFlow
from mstar.model.piper.duration import DurationPredictor
from mstar.model.piper.encoder import TextEncoder, sequence_mask

__all__ = ["PiperNoise", "PiperOutput", "PiperVits", "expand_by_durations"]


@dataclass(frozen=True)
class PiperNoise:
    """Per-row noise sources: a generator per row, or fixed unit-normal tensors for tests.

    ``duration``: ``[B, 2, T_text]``; ``prior``: ``[B, C, T_frames]`` (longer is cropped).
    """

    generators: list[torch.Generator | None] | None = None
    duration: torch.Tensor | None = None
    prior: torch.Tensor | None = None

    def draw(self, which: str, shape: tuple[int, ...], lengths: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Unit-normal noise of ``shape`` ``[B, C, T]``; row ``b`` drawn at its own length."""
        fixed = self.duration if which == "duration" else self.prior
        if fixed is not None:
            return fixed[..., :shape[-1]].to(like)
        out = torch.zeros(shape, dtype=like.dtype, device=like.device)
        for b in range(shape[0]):
            gen = self.generators[b] if self.generators else None
            n = int(lengths[b])
            out[b, :, :n] = torch.randn((shape[1], n), generator=gen, device="cpu" if gen is None
                                        else gen.device, dtype=like.dtype).to(like.device)
        return out


@dataclass(frozen=True)
class PiperOutput:
    """``audio``: ``[B, T_audio]`` zero past each row's ``lengths`` (in samples)."""

    audio: torch.Tensor
    lengths: torch.Tensor


def expand_by_durations(x: torch.Tensor, durations: torch.Tensor, n_frames: int) -> torch.Tensor:
    """Repeat phoneme ``i`` of ``x`` (``[B, C, T_text]``) ``durations[b, i]`` times along time.

    Built as the hard alignment matrix VITS uses (frame ``t`` belongs to the phoneme whose
    cumulative-duration interval holds it), so frames past a row's total are zero.
    """
    end = torch.cumsum(durations, dim=-1)
    start = end - durations
    t = torch.arange(n_frames, device=x.device, dtype=durations.dtype)
    path = (t[None, None, :] >= start[..., None]) & (t[None, None, :] < end[..., None])
    return x @ path.to(x.dtype)


class PiperVits(nn.Module):
    """``enc_p``, ``dp``, ``flow``, ``dec`` (+ ``emb_g`` for multi-speaker voices)."""

    def __init__(self, arch: PiperArch) -> None:
        super().__init__()
        self.arch = arch
        self.enc_p = TextEncoder(arch)
        self.dp = DurationPredictor(arch)
        self.flow = ResidualCouplingFlow(arch)
        self.dec = Generator(arch)
        self.emb_g = nn.Embedding(arch.n_speakers, arch.gin_channels) if arch.n_speakers > 1 else None

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, *, noise_scale: torch.Tensor,
                length_scale: torch.Tensor, noise_w: torch.Tensor, noise: PiperNoise,
                speakers: torch.Tensor | None = None) -> PiperOutput:
        """``ids``: ``[B, T]`` int; ``lengths``, scales, ``speakers``: ``[B]``."""
        g = self.emb_g(speakers).unsqueeze(-1) if self.emb_g is not None and speakers is not None else None
        x, mean, log_std, mask = self.enc_p(ids, lengths)
        dp_noise = noise.draw("duration", (ids.shape[0], 2, ids.shape[1]), lengths, x) * noise_w[:, None, None]
        log_w = self.dp(x, mask, dp_noise, g=g)
        w = torch.ceil(torch.exp(log_w) * mask * length_scale[:, None, None])[:, 0]
        frames = torch.clamp_min(w.sum(dim=-1), 1).long()
        n_frames = int(frames.max())
        frame_mask = sequence_mask(frames, n_frames).unsqueeze(1).to(x.dtype)
        mean = expand_by_durations(mean, w, n_frames)
        log_std = expand_by_durations(log_std, w, n_frames)
        prior = noise.draw("prior", tuple(mean.shape), frames, mean)
        z_p = mean + prior * torch.exp(log_std) * noise_scale[:, None, None]
        z = self.flow.reverse(z_p * frame_mask, frame_mask, g=g) * frame_mask
        audio = self.dec(z, frames, g=g)[:, 0]
        return PiperOutput(audio=audio, lengths=frames * self.arch.hop_length)
