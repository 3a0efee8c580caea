"""Chatterbox's voice encoder (Resemble's take on the GE2E speaker encoder of
Real-Time-Voice-Cloning): 16 kHz speech -> one L2-normalised 256-d speaker embedding, the
``speaker_emb`` T3 conditions on.

The maths, per clip (``embeds_from_wavs`` with Chatterbox's arguments):

- trim leading and trailing silence (``trim_silence``, librosa's ``effects.trim`` at
  ``top_db=20``): the clip is cut to the 512-sample hops, of 2048-sample centred frames,
  whose mean power is within 20 dB of the loudest frame's;
- 40-bin mel *power* (no log): a centred STFT (400-point periodic Hann, hop 160, reflect
  padding), ``|X|^2``, a Slaney mel filterbank up to 8 kHz; ``1 + len // 160`` frames;
- partial utterances of 160 frames every 77 frames (``rate=1.3``: ``round(16000 / 1.3 / 160)``):
  as many windows as fit, plus one more if the tail it would add covers at least 80 % of a
  window; the mel is zero-padded or cut to exactly cover them;
- each window through a 3-layer LSTM (256), the last layer's final hidden state through a
  linear map, ReLU and L2 normalisation; the windows' embeddings are averaged and the mean
  L2-normalised.

Parameter names are ``ve.safetensors``' (``lstm.weight_ih_l0``, ``proj.weight``, ...); its
``similarity_weight`` and ``similarity_bias`` (the training loss's scale) are not used and
``voice_encoder_name_map`` skips them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.audio.mel import mel_filterbank

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
TRIM_FRAME = 2048
TRIM_HOP = 512


@dataclass(frozen=True)
class VoiceEncoderConfig:
    """Dimensions and windowing; the defaults are Chatterbox's ``VoiceEncConfig`` and the
    arguments ``ChatterboxTTS.prepare_conditionals`` uses."""

    n_mels: int = 40
    hidden_size: int = 256
    embed_size: int = 256
    num_layers: int = 3
    partial_frames: int = 160
    rate: float = 1.3  # partial windows a second, as the reference counts them
    min_coverage: float = 0.8
    trim_top_db: float | None = 20.0

    @property
    def frame_step(self) -> int:
        """Frames between two partial windows (77 at the defaults)."""
        step = round((SAMPLE_RATE / self.rate) / self.partial_frames)
        if not 0 < step <= self.partial_frames:
            raise ValueError(f"partial windows every {step} frames do not fit {self.partial_frames}-frame windows")
        return step


# ----------------------------------------------------------------------------- features
def trim_silence(wave: torch.Tensor, top_db: float) -> torch.Tensor:
    """``wave [len]`` without its leading and trailing quiet: librosa's ``effects.trim``
    (RMS of 2048-sample frames centred every 512 samples on a zero-padded clip, kept where
    within ``top_db`` of the loudest, cut on the hop grid). The loudest hop is always kept, so
    an all-zero clip is kept whole."""
    padded = F.pad(wave, (TRIM_FRAME // 2, TRIM_FRAME // 2))
    frames = padded.unfold(0, TRIM_FRAME, TRIM_HOP)
    power = frames.square().mean(dim=-1)
    # power_to_db with amin 1e-10 against the loudest frame
    db = 10.0 * torch.log10(power.clamp(min=1e-10)) - 10.0 * torch.log10(power.max().clamp(min=1e-10))
    loud = torch.nonzero(db > -top_db).flatten()
    if loud.numel() == 0:
        return wave[:0]
    start = int(loud[0]) * TRIM_HOP
    end = min(wave.shape[0], (int(loud[-1]) + 1) * TRIM_HOP)
    return wave[start:end]


def mel_power(wave: torch.Tensor, n_mels: int = 40) -> torch.Tensor:
    """Mel power ``[1 + len // 160, n_mels]`` (float32) of one 16 kHz clip."""
    window = torch.hann_window(N_FFT, dtype=torch.float32, device=wave.device)
    stft = torch.stft(wave.to(torch.float32), N_FFT, HOP, window=window, pad_mode="reflect", return_complex=True)
    filters = mel_filterbank(n_mels, N_FFT, SAMPLE_RATE, SAMPLE_RATE / 2).to(wave.device, torch.float32)
    return (filters @ stft.abs().square()).T


def partial_windows(num_frames: int, step: int, window: int, min_coverage: float) -> tuple[int, int]:
    """How many ``window``-frame partials every ``step`` frames a clip of ``num_frames`` gives,
    and the frames they span: whole windows that fit, plus one when the frames left over would
    cover at least ``min_coverage`` of it (always at least one)."""
    if num_frames <= 0:
        raise ValueError("the clip has no frames to embed")
    count, remainder = divmod(max(num_frames - window + step, 0), step)
    if count == 0 or (remainder + (window - step)) / window >= min_coverage:
        count += 1
    return count, window + step * (count - 1)


# ----------------------------------------------------------------------------- network
class VoiceEncoder(nn.Module):
    """16 kHz clips -> speaker embeddings ``[B, embed_size]``, batched over clips of different
    lengths (every clip's partial windows go through the LSTM together).

    ``VoiceEncoder(config)(clips)`` takes a list of ``[num_samples]`` tensors (or a
    ``[B, num_samples]`` tensor); ``embed_partials`` runs the network on windows
    ``[N, partial_frames, n_mels]``.
    """

    def __init__(self, config: VoiceEncoderConfig | None = None) -> None:
        super().__init__()
        self.config = config or VoiceEncoderConfig()
        c = self.config
        self.lstm = nn.LSTM(c.n_mels, c.hidden_size, num_layers=c.num_layers, batch_first=True)
        self.proj = nn.Linear(c.hidden_size, c.embed_size)

    def features(self, clip: torch.Tensor) -> torch.Tensor:
        """One clip's mel power ``[frames, n_mels]``, silence trimmed first when configured."""
        wave = torch.as_tensor(clip).to(torch.float32)
        if wave.dim() != 1 or wave.shape[0] <= N_FFT // 2:
            raise ValueError(f"expected one mono clip of over {N_FFT // 2} samples, got {tuple(wave.shape)}")
        if self.config.trim_top_db is not None:
            wave = trim_silence(wave, self.config.trim_top_db)
        return mel_power(wave, self.config.n_mels)

    def partials(self, mel: torch.Tensor) -> torch.Tensor:
        """The overlapping windows ``[N, partial_frames, n_mels]`` of one clip's mel."""
        c = self.config
        count, span = partial_windows(mel.shape[0], c.frame_step, c.partial_frames, c.min_coverage)
        mel = F.pad(mel, (0, 0, 0, max(span - mel.shape[0], 0)))[:span]
        return mel.unfold(0, c.partial_frames, c.frame_step).transpose(1, 2)[:count]

    def embed_partials(self, windows: torch.Tensor) -> torch.Tensor:
        """L2-normalised embeddings ``[N, embed_size]`` of windows ``[N, frames, n_mels]`` (in the
        weights' dtype)."""
        _, (hidden, _) = self.lstm(windows.to(self.proj.weight.dtype))
        raw = F.relu(self.proj(hidden[-1]))
        return raw / torch.linalg.norm(raw, dim=1, keepdim=True)

    @torch.no_grad()
    def forward(self, clips: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        device = self.proj.weight.device
        windows = [self.partials(self.features(torch.as_tensor(clip).to(device))) for clip in clips]
        embeds = self.embed_partials(torch.cat(windows)).split([len(w) for w in windows])
        means = torch.stack([e.mean(dim=0) for e in embeds])
        return means / torch.linalg.norm(means, dim=1, keepdim=True)


def voice_encoder_name_map(prefix: str = "") -> Callable[[str], str | None]:
    """A ``load_weights`` name map for ``ve.safetensors`` (``prefix`` when stored inside a larger
    file): the training-only similarity scale is skipped by name, so any other stray tensor
    still fails the coverage check."""
    unused = {"similarity_weight", "similarity_bias"}

    def rename(name: str) -> str | None:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix):]
        return None if name in unused else name

    return rename
