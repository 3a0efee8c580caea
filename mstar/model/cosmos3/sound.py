"""Cosmos3's sound on the serving side: the ``sound`` node (the AVAE decoder: final sound latents
-> a waveform) and the output stream that sends a request's frames and its soundtrack.

A clip of ``num_frames`` at ``fps`` gets ``int(num_frames / fps * sampling_rate)`` samples of
sound, as the pipeline sizes it: ``ceil(samples / hop)`` latents, whose decode is a little longer
(``latents * hop`` samples); the stream cuts the waveform to the clip's length, so the mp4's audio
lasts as long as its video.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from mstar.contract import OutputEvent
from mstar.engine.base import StatelessEngine
from mstar.model.cosmos3.sound_tokenizer import Cosmos3SoundTokenizer, SoundTokenizerConfig
from mstar.model.video_output import VideoFrames

__all__ = ["SoundLayout", "SoundVideoStream", "sound_engine"]


@dataclass(frozen=True)
class SoundLayout:
    """What the frontend needs of a sound-capable checkpoint."""

    sampling_rate: int
    channels: int
    hop: int  # waveform samples per sound latent
    dim: int  # latent channels (the tower's sound_dim)

    @classmethod
    def of(cls, tokenizer: SoundTokenizerConfig, sound_dim: int) -> SoundLayout:
        if tokenizer.vocoder_input_dim != sound_dim:
            raise ValueError(f"sound_tokenizer vocoder_input_dim {tokenizer.vocoder_input_dim} != the transformer's "
                             f"sound_dim {sound_dim}")
        return cls(tokenizer.sampling_rate, tokenizer.dec_out_channels, tokenizer.hop, sound_dim)

    def samples(self, num_frames: int, fps: float) -> int:
        """The clip's length in waveform samples (the pipeline's ``int(frames / fps * rate)``)."""
        return int(num_frames / fps * self.sampling_rate)

    def latent_shape(self, num_frames: int, fps: float) -> tuple[int, int]:
        return self.dim, -(-self.samples(num_frames, fps) // self.hop)


def sound_engine(tokenizer: Cosmos3SoundTokenizer, device: torch.device) -> StatelessEngine:
    """Op ``decode``: ``sound_latents [sound_dim, T]`` -> ``waveform`` float32 ``[channels,
    T * hop]`` in [-1, 1] (on the CPU); requests of one length decode together."""

    def run(op, items):
        if op != "decode":
            raise ValueError(f"the Cosmos3 sound decoder has no op {op!r} (it has ['decode'])")
        by_shape = defaultdict(list)
        for i, item in enumerate(items):
            by_shape[tuple(item.inputs["sound_latents"].shape)].append(i)
        out: list[dict | None] = [None] * len(items)
        for rows in by_shape.values():
            latents = torch.stack([items[i].inputs["sound_latents"] for i in rows]).to(device)
            for i, wave in zip(rows, tokenizer.decode(latents).float().cpu()):
                out[i] = {"waveform": wave}
        return out

    return StatelessEngine(run)


class SoundVideoStream(VideoFrames):
    """Frames as ``VideoFrames`` sends them; the waveform, cut to ``samples``, as one ``audio``
    event of interleaved 16-bit little-endian PCM (what the video routes mux as AAC)."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        self.samples = samples

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if modality != "audio":
            return super().feed(modality, value)
        pcm = (value[:, :self.samples].float().clamp(-1, 1) * 32767).round().to(torch.int16).T.contiguous()
        return OutputEvent(modality="audio", data=pcm.numpy().astype("<i2").tobytes())
