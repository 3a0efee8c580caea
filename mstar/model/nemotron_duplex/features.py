"""The VoiceChat front end: 16 kHz mono audio to log-mel frames, whole or streamed.

It is the FastConformer front end (pre-emphasis ``x[t] - 0.97 x[t-1]``, a 512-point STFT of a
400-sample Hann window, hop 160, Slaney mels, ``log(x + 2^-24)``) as the VoiceChat reference
computes it, which predates NeMo 2.5: the clip's edges are *reflected* for the centred STFT
and a clip of ``N`` samples keeps ``N // 160 + 1`` frames. No per-bin normalisation over the
clip (a live call has no whole clip to normalise over).

``MelStream`` computes the same frames as they become final: frame ``t`` reads samples
``[160 t - 256, 160 t + 256)``, so it is final once ``160 t + 256`` samples arrived; the
frames that read the reflected right edge wait for the end of input.
"""

from __future__ import annotations

import torch

from mstar.audio.mel import mel_filterbank
from mstar.model.fastconformer.features import LOG_GUARD, MelSettings

SAMPLE_RATE = 16000
MIN_SAMPLES = 257  # the reflected edge needs n_fft // 2 + 1 samples (about 16 ms)


def duplex_settings(n_mels: int = 128) -> MelSettings:
    return MelSettings(n_mels=n_mels, normalize=False)


class _Bank:
    """The window and filters of one setting, made once."""

    def __init__(self, settings: MelSettings, device: torch.device | str = "cpu") -> None:
        self.settings = settings
        self.window = torch.hann_window(settings.win_length, periodic=False, device=device)
        self.filters = mel_filterbank(settings.n_mels, settings.n_fft, settings.sample_rate,
                                      settings.sample_rate / 2).to(device, torch.float32)

    def frames(self, padded: torch.Tensor) -> torch.Tensor:
        """Log-mels ``[frames, n_mels]`` of an already padded signal (no centring); of a batch
        of equal-length signals ``[B, n]``, ``[B, frames, n_mels]``."""
        s = self.settings
        stft = torch.stft(padded, s.n_fft, hop_length=s.hop_length, win_length=s.win_length, window=self.window,
                          center=False, return_complex=True)
        power = torch.view_as_real(stft).pow(2).sum(-1)
        return torch.log(self.filters @ power + LOG_GUARD).transpose(-1, -2).contiguous()


def _check(n: int) -> None:
    if n < MIN_SAMPLES:
        raise ValueError(f"{n} samples are too short to featurize (at least {MIN_SAMPLES}, about 16 ms)")


def preemphasis(wave: torch.Tensor, coefficient: float, previous: float | None = None) -> torch.Tensor:
    """``x[t] - c x[t-1]``; the first sample kept as it is, or filtered against ``previous``."""
    if wave.numel() == 0:
        return wave
    first = wave[:1] if previous is None else wave[:1] - coefficient * previous
    return torch.cat([first, wave[1:] - coefficient * wave[:-1]])


def duplex_log_mel(samples: torch.Tensor, settings: MelSettings) -> torch.Tensor:
    """The offline pass: ``[N // 160 + 1, n_mels]`` of one mono clip."""
    wave = torch.as_tensor(samples).to(torch.float32).flatten()
    _check(wave.shape[0])
    y = preemphasis(wave, settings.preemphasis or 0.0)
    half = settings.n_fft // 2
    padded = torch.nn.functional.pad(y[None, None], (half, half), mode="reflect")[0, 0]
    return _Bank(settings, wave.device).frames(padded)


class MelStream:
    """One call's front end: ``push`` samples, get the mel frames that became final; ``end``
    gives the last ones (those that read the reflected right edge). Together they equal
    ``duplex_log_mel`` of the whole call. It keeps only the samples later frames read."""

    def __init__(self, settings: MelSettings, bank: _Bank | None = None) -> None:
        self.settings = settings
        self.bank = bank or _Bank(settings)
        self.y = torch.zeros(0)  # pre-emphasised samples from global index ``start``
        self.start = 0
        self.received = 0
        self.last_raw: float | None = None
        self.done = 0  # mel frames given out so far
        self.ended = False

    def push(self, samples: torch.Tensor) -> torch.Tensor:
        self._take(samples)
        return self._frames(self._final())

    def end(self) -> torch.Tensor:
        return self._frames(self._end())

    def _take(self, samples: torch.Tensor) -> None:
        wave = torch.as_tensor(samples).to(torch.float32).flatten()
        if wave.numel():
            coefficient = self.settings.preemphasis or 0.0
            self.y = torch.cat([self.y, preemphasis(wave, coefficient, self.last_raw)])
            self.last_raw = float(wave[-1])
            self.received += wave.numel()

    def _final(self) -> int:
        """The mel frames final so far (``160 t + 256 <= N``)."""
        hop, half = self.settings.hop_length, self.settings.n_fft // 2
        return (self.received - half) // hop + 1 if self.received >= MIN_SAMPLES else 0

    def _end(self) -> int:
        """Ends the input: every frame is final, those reading the reflected right edge too."""
        _check(self.received)
        self.ended = True
        return self.received // self.settings.hop_length + 1

    def _frames(self, upto: int) -> torch.Tensor:
        segment = self._segment(upto)
        return torch.zeros(0, self.settings.n_mels) if segment is None else self.bank.frames(segment)

    def _segment(self, upto: int) -> torch.Tensor | None:
        """The padded signal frames ``[done, upto)`` read (None: no new frame); moves on."""
        if upto <= self.done:
            return None
        hop, half, n = self.settings.hop_length, self.settings.n_fft // 2, self.received
        index = torch.arange(self.done * hop - half, (upto - 1) * hop + half)
        index = torch.where(index < 0, -index, index)  # the reflected left edge
        index = torch.where(index >= n, 2 * n - 2 - index, index)  # the right one (only at the end)
        segment = self.y[index - self.start]
        self.done = upto
        keep = max(0, self.done * hop - 2 * half)  # what the next frames (or the right reflection) read
        self.y, self.start = self.y[keep - self.start:], keep
        return segment


def push_many(streams: list[MelStream], samples: list[torch.Tensor], ends: list[bool]) -> list[torch.Tensor]:
    """Each stream's ``push`` of its samples (then its ``end`` where ``ends``), the STFTs of the
    streams whose new frames read equally long signals (every call of a steady tick) in one
    batch."""
    segments = []
    for stream, wave, end in zip(streams, samples, ends, strict=True):
        stream._take(wave)
        segments.append(stream._segment(stream._end() if end else stream._final()))
    out = [torch.zeros(0, stream.settings.n_mels) for stream in streams]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, segment in enumerate(segments):
        if segment is not None:
            groups.setdefault((segment.shape[0], id(streams[i].bank)), []).append(i)
    for group in groups.values():
        frames = streams[group[0]].bank.frames(torch.stack([segments[i] for i in group]))
        for row, i in enumerate(group):
            out[i] = frames[row]
    return out
