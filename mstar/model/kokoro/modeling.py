"""Kokoro-82M: phoneme ids + a voice vector + speed -> 24 kHz audio, not autoregressive.

The forward has two halves:

- the **text half**, batched over rows of different lengths (padding masked everywhere):
  PL-BERT and ``bert_encoder`` give the prosody features, the predictor's duration encoder
  and LSTM give each phoneme's duration (``round(sum(sigmoid(logits)) / speed)``, at least one
  frame), and the text encoder the phonetic features;
- the **frame half**: each phoneme's features repeated for its duration (the hard
  alignment), the F0/energy curves, and the decoder to audio. One row runs unpadded
  (``frame_half``); several run as one batch padded to the longest row's frame count
  (``frame_halves``), every time-mixing op made length-aware (instance-norm statistics over a
  row's own frames, zeros past a row's end before each convolution, the LSTM packed, the
  source's STFT and the iSTFT per row length, each row's noise from its own generator), so a
  row's audio does not depend on what it was batched with.

The voice vector is ``2 * style_dim`` wide: ``[:style_dim]`` styles the decoder,
``[style_dim:]`` the prosody. Module names are the reference ``KModel``'s (``bert``,
``bert_encoder``, ``predictor``, ``text_encoder``, ``decoder``), so checkpoint keys load by name
(``checkpoint.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.model.kokoro.albert import PLBert
from mstar.model.kokoro.config import KokoroConfig
from mstar.model.kokoro.decoder import KokoroDecoder
from mstar.model.kokoro.prosody import ProsodyPredictor
from mstar.model.kokoro.text import TextEncoder

__all__ = ["FRAME_BUCKET", "KokoroModel", "TextHalf"]

FRAME_BUCKET = 64
"""The batched frame half pads its frame count up to a multiple of this, so a batch sees few
distinct shapes (for a future CUDA-graph path; the padding changes no row's audio)."""


@dataclass
class TextHalf:
    """The text half's results for a batch: per row, everything the frame half reads."""

    durations: torch.Tensor  # [B, T] long, frames per phoneme (0 at padding)
    prosody: torch.Tensor  # [B, T, hidden + style]: the duration encoder's output
    phonetic: torch.Tensor  # [B, hidden, T]: the text encoder's output
    lengths: torch.Tensor  # [B]


class KokoroModel(nn.Module):
    def __init__(self, config: KokoroConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = PLBert(config.plbert, config.n_token)
        self.bert_encoder = nn.Linear(config.plbert.hidden_size, config.hidden_dim)
        self.predictor = ProsodyPredictor(config.style_dim, config.hidden_dim, config.n_layer, config.max_dur)
        self.text_encoder = TextEncoder(config.hidden_dim, config.text_encoder_kernel_size, config.n_layer,
                                        config.n_token)
        self.decoder = KokoroDecoder(config)

    def text_half(
        self, ids: torch.Tensor, lengths: torch.Tensor, voices: torch.Tensor, speed: torch.Tensor
    ) -> TextHalf:
        """``ids`` ``[B, T]`` (boundary pads included, padded to ``T``), ``lengths`` ``[B]``,
        ``voices`` ``[B, 2 * style_dim]``, ``speed`` ``[B]``."""
        t = ids.shape[1]
        keep = torch.arange(t, device=ids.device)[None] < lengths[:, None]
        pad = ~keep
        s = voices[:, self.config.style_dim :]
        features = self.bert_encoder(self.bert(ids, keep)).transpose(1, 2)  # [B, hidden, T]
        prosody = self.predictor.text_encoder(features, s, lengths, pad)
        frames = self.predictor.durations(prosody, lengths, speed)
        durations = torch.round(frames).clamp(min=1).long().masked_fill(pad, 0)
        phonetic = self.text_encoder(ids, lengths, pad)
        return TextHalf(durations, prosody, phonetic, lengths)

    def frame_half(
        self,
        half: TextHalf,
        row: int,
        voice: torch.Tensor,
        *,
        noise: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Row ``row`` of ``half`` with its voice ``[2 * style_dim]`` -> audio ``[samples]``."""
        n = int(half.lengths[row])
        durations = half.durations[row, :n]
        # the hard alignment as a gather: frame j reads the phoneme it falls in
        index = torch.repeat_interleave(torch.arange(n, device=durations.device), durations)
        prosody = half.prosody[row : row + 1, :n].index_select(1, index).transpose(1, 2)  # [1, C + S, F]
        phonetic = half.phonetic[row : row + 1, :, :n].index_select(2, index)  # [1, hidden, F]
        style = self.config.style_dim
        f0, energy = self.predictor.f0_n(prosody, voice[None, style:])
        audio = self.decoder(phonetic, f0, energy, voice[None, :style], noise=noise, generator=generator)
        return audio.reshape(-1)

    def frame_halves(
        self,
        half: TextHalf,
        voices: torch.Tensor,
        *,
        noise: bool = True,
        generators: list[torch.Generator | None] | None = None,
        bucket: int = FRAME_BUCKET,
    ) -> list[torch.Tensor]:
        """Every row of ``half`` as one padded batch, voices ``[B, 2 * style_dim]`` -> audio per
        row (each its solo audio). The one host sync is the durations' copy: the frame counts
        size the padding, the LSTM packing, the noise draws and the final trim."""
        durations = half.durations
        counts = durations.sum(dim=1)
        frames = counts.cpu().tolist()
        padded = -(-max(frames) // bucket) * bucket
        # the hard alignment as a gather: frame j of a row reads the phoneme whose span holds j
        ends = durations.cumsum(dim=1)
        at = torch.arange(padded, device=durations.device).expand(durations.shape[0], -1).contiguous()
        index = torch.searchsorted(ends, at, right=True).clamp(max=durations.shape[1] - 1)
        prosody = half.prosody.gather(1, index[..., None].expand(-1, -1, half.prosody.shape[2]))
        phonetic = half.phonetic.gather(2, index[:, None].expand(-1, half.phonetic.shape[1], -1))
        style = self.config.style_dim
        f0, energy = self.predictor.f0_n(prosody.transpose(1, 2), voices[:, style:], frames, counts)
        audio = self.decoder.forward_rows(phonetic, f0, energy, voices[:, :style], frames, noise=noise,
                                          generators=generators, counts=counts)
        per_frame = self.config.generator_config().samples_per_frame * 2
        return [audio[i, 0, : n * per_frame] for i, n in enumerate(frames)]

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        voices: torch.Tensor,
        speed: torch.Tensor | float = 1.0,
        lengths: torch.Tensor | None = None,
        *,
        noise: bool = True,
        generators: list[torch.Generator | None] | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Audio per row and the durations ``[B, T]``; ``generators`` (one per row) seed each
        row's harmonic-source noise (``None``: torch's global generator). One row runs its
        frame half unpadded, several as one padded batch (``frame_halves``)."""
        b = ids.shape[0]
        if lengths is None:
            lengths = torch.full((b,), ids.shape[1], dtype=torch.long, device=ids.device)
        speed = torch.as_tensor(speed, dtype=voices.dtype, device=ids.device).expand(b)
        half = self.text_half(ids, lengths, voices, speed)
        gens = generators or [None] * b
        if b == 1:
            return [self.frame_half(half, 0, voices[0], noise=noise, generator=gens[0])], half.durations
        return self.frame_halves(half, voices, noise=noise, generators=gens), half.durations
