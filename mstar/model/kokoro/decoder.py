"""Kokoro's decoder: the aligned text features, F0 and energy curves and the decoder half of
the voice vector -> 24 kHz audio.

F0 and energy (at twice the frame rate) are brought to the frame rate by a strided conv each
and joined to the text features; an ``AdainResBlk1d`` trunk (1024 channels; the text features'
64-channel skip and the curves re-joined before each block until the one that doubles the
frame rate, 512 channels out) feeds the shared iSTFTNet generator, which also takes the F0
curve itself for its harmonic source.

``forward_rows`` runs rows padded to one frame length (each row's audio its solo audio): the
trunk's blocks take a ``keep`` mask, and the generator its ``forward_rows``.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.model.kokoro.blocks import AdainResBlk1d
from mstar.model.kokoro.config import DECODER_OUT_CHANNELS, KokoroConfig
from mstar.model.vocoder import ISTFTNetGenerator, prefix_mask, zero_padding

__all__ = ["KokoroDecoder"]

TRUNK_CHANNELS = 1024
SKIP_CHANNELS = 64


class KokoroDecoder(nn.Module):
    def __init__(self, config: KokoroConfig) -> None:
        super().__init__()
        dim_in, style = config.hidden_dim, config.style_dim
        joined = TRUNK_CHANNELS + 2 + SKIP_CHANNELS
        self.encode = AdainResBlk1d(dim_in + 2, TRUNK_CHANNELS, style)
        self.decode = nn.ModuleList([
            AdainResBlk1d(joined, TRUNK_CHANNELS, style),
            AdainResBlk1d(joined, TRUNK_CHANNELS, style),
            AdainResBlk1d(joined, TRUNK_CHANNELS, style),
            AdainResBlk1d(joined, DECODER_OUT_CHANNELS, style, upsample=True),
        ])
        self.F0_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.N_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.asr_res = nn.Sequential(nn.Conv1d(dim_in, SKIP_CHANNELS, 1))
        self.generator = ISTFTNetGenerator(config.generator_config())

    def forward(
        self,
        asr: torch.Tensor,
        f0: torch.Tensor,
        energy: torch.Tensor,
        s: torch.Tensor,
        *,
        noise: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``asr`` ``[B, hidden, F]``, ``f0``/``energy`` ``[B, 2F]``, ``s`` ``[B, style]`` ->
        ``[B, 1, 2F * samples per generator frame]``."""
        f0_frames = self.F0_conv(f0[:, None])
        n_frames = self.N_conv(energy[:, None])
        x = self.encode(torch.cat([asr, f0_frames, n_frames], dim=1), s)
        skip = self.asr_res(asr)
        joining = True
        for block in self.decode:
            if joining:
                x = torch.cat([x, skip, f0_frames, n_frames], dim=1)
            x = block(x, s)
            joining = joining and not block.upsample
        return self.generator(x, s, f0, noise=noise, generator=generator)

    def forward_rows(
        self,
        asr: torch.Tensor,
        f0: torch.Tensor,
        energy: torch.Tensor,
        s: torch.Tensor,
        lengths: list[int],
        *,
        noise: bool = True,
        generators: list[torch.Generator | None] | None = None,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` of rows padded to ``F`` frames, row ``i`` valid for ``lengths[i]``
        (host ints; ``counts`` the same on the device; ``f0``/``energy`` for twice that) ->
        ``[B, 1, 2F * samples per generator frame]``, row ``i`` valid for ``2 * lengths[i]``
        generator frames' samples."""
        counts = torch.tensor(lengths, device=asr.device) if counts is None else counts
        keep = prefix_mask(counts, asr.shape[-1])
        keep2 = keep.repeat_interleave(2, dim=1)
        f0, energy = torch.where(keep2, f0, 0.0), torch.where(keep2, energy, 0.0)
        asr = zero_padding(asr, keep)
        f0_frames = self.F0_conv(f0[:, None])
        n_frames = self.N_conv(energy[:, None])
        x = self.encode(torch.cat([asr, f0_frames, n_frames], dim=1), s, keep)
        skip = self.asr_res(asr)
        joining = True
        for block in self.decode:
            if joining:
                x = torch.cat([x, skip, f0_frames, n_frames], dim=1)
            x = block(x, s, keep)
            if block.upsample:
                keep = keep2
            joining = joining and not block.upsample
        return self.generator.forward_rows(x, s, f0, [2 * n for n in lengths], noise=noise, generators=generators,
                                           counts=2 * counts)
