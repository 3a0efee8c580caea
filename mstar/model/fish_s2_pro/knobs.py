"""Fish S2-Pro's deployment knobs (the frame budget, the codec's chunks, the clip memo's bytes,
preset voices) and the options of a speech request."""

from __future__ import annotations

from pydantic import Field, field_validator

from mstar.model.knobs import RequestKnobs
from mstar.model.voice_cloning import ConditioningCacheKnobs

__all__ = ["FishS2ProKnobs", "FishSpeechKnobs"]

MAX_FRAMES = 4096  # the reference's ceiling: about 190 s at 44.1 kHz, 2048 samples a frame


class FishS2ProKnobs(ConditioningCacheKnobs):
    max_new_frames: int = Field(2048, ge=1, le=MAX_FRAMES)
    """Frames (2048 samples each: about 21.5 a second) a request may speak when it sends no
    ``max_tokens``."""

    codec_chunk_schedule: list[int] = Field(default_factory=lambda: [2, 4, 8])
    """New frames of the codec's first chunks (the first audio waits for the first chunk),
    before chunks of ``codec_chunk_frames``. The codec is causal with its state kept per
    request, so a chunk needs no left context and its size changes only the latency."""

    codec_chunk_frames: int = Field(16, ge=1)
    """New frames of every later codec chunk."""

    voices_dir: str | None = None
    """A directory of preset voices: ``<name>.wav`` (or .flac, .ogg, .mp3) with its transcript
    in ``<name>.txt`` (required: S2-Pro clones from a clip and its transcript). A request's
    ``voice`` naming one clones it as if its clip and transcript were sent; /v1/audio/voices
    lists them."""

    @field_validator("codec_chunk_schedule")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError(f"every chunk needs at least one new frame, got {value}")
        return value


class FishSpeechKnobs(RequestKnobs):
    """A speech request's ``model_kwargs``: fish-speech's sampling (top-k and top-p over the
    untempered probabilities, then the temperature; the slow token and every codebook alike)
    and the frame budget."""

    temperature: float = Field(0.8, ge=0.0, le=2.0)
    """0 is greedy (argmax everywhere)."""

    top_p: float = Field(0.8, gt=0.0, le=1.0)
    top_k: int = Field(30, ge=1)
    seed: int | None = Field(None, ge=0)
    """Seeds the request's draws (unset: fresh randomness); a seeded request speaks the same
    audio alone or batched."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_FRAMES)
    """Frames at most (default: the deployment's ``max_new_frames``)."""

    max_new_tokens: int | None = Field(None, ge=1, le=MAX_FRAMES)
    """The same as ``max_tokens`` (the reference's name); ``max_tokens`` wins when both are sent."""

    ignore_eos: bool = False
    """Never draw ``<|im_end|>``: speak exactly the frame budget (benchmarks)."""

    repetition_aware: bool = True
    """Redraw a slow token that repeats one of the last 10 (at temperature 1, top-p 0.9), as
    the reference does."""

    @property
    def frames(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_new_tokens
