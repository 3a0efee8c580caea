"""The output side shared by the speech families: emitted audio tensors -> client events
carrying mono float32 little-endian PCM, and the reverse for tests and benchmarks; and the
check every text-to-speech family makes of a ``/generate`` request."""

from __future__ import annotations

import numpy as np
import torch

from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.model.spec import OutputStream

__all__ = ["PcmStream", "check_speech_generate", "pcm_to_array"]


class PcmStream(OutputStream):
    """Emitted audio chunks -> events carrying float32 PCM bytes at ``sample_rate``."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self.samples = 0

    @property
    def generated(self) -> int:
        return self.samples

    @property
    def media_seconds(self) -> float:
        return self.samples / self.sample_rate

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        pcm = value.detach().float().reshape(-1).numpy().astype("<f4")
        self.samples += pcm.size
        return OutputEvent(modality="audio", data=pcm.tobytes()) if pcm.size else None


def pcm_to_array(events: list[OutputEvent]) -> np.ndarray:
    """The float32 samples of a request's audio events, joined."""
    return np.concatenate([np.frombuffer(e.data, "<f4") for e in events if e.data] or [np.zeros(0, "<f4")])


def check_speech_generate(key: str, spec: GenerateSpec, *, clones: bool = False) -> None:
    """A ``/generate`` request to the text-to-speech model ``key``: audio out, text in (a model
    that ``clones`` takes its voice clip as ``ref_audio``, not as an uploaded file)."""
    if set(spec.output_modalities) != {"audio"}:
        raise RequestError("output_modalities", f"model {key!r} outputs audio only")
    if spec.files:
        takes = "text, and a voice as ref_audio" if clones else "text only"
        raise RequestError("files", f"model {key!r} takes {takes}")
