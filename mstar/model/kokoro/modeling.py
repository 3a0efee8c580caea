"""Kokoro-82M: phoneme ids + a voice vector + speed -> 24 kHz audio, not autoregressive.

The forward has two halves:

- the **text half**, batched over rows of different lengths (padding masked everywhere):
  PL-BERT and ``bert_encoder`` give the prosody features, the predictor's duration encoder
  and LSTM give each phoneme's duration (``round(sum(sigmoid(logits)) / speed)``, at least one
  frame), and the text encoder the phonetic features;
- the **frame half**, per row: each phoneme's features repeated for its duration (the hard
  alignment), the F0/energy curves, and the decoder to audio. Instance norms in the decoder
  normalise over the whole utterance, so rows run one at a time here and a row's audio does
  not depend on what it was batched with.

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

__all__ = ["KokoroModel", "TextHalf"]


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
        row's harmonic-source noise (``None``: torch's global generator)."""
        b = ids.shape[0]
        if lengths is None:
            lengths = torch.full((b,), ids.shape[1], dtype=torch.long, device=ids.device)
        speed = torch.as_tensor(speed, dtype=voices.dtype, device=ids.device).expand(b)
        half = self.text_half(ids, lengths, voices, speed)
        gens = generators or [None] * b
        audio = [self.frame_half(half, i, voices[i], noise=noise, generator=gens[i]) for i in range(b)]
        return audio, half.durations
