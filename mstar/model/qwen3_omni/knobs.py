"""Qwen3-Omni's deployment knobs (the talker's pool and budget, the codec's chunk schedule, the
input budgets) and the options of a ``/generate`` request."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mstar.model.chat import GenerateKnobs
from mstar.model.knobs import FusedKernels


class Qwen3OmniKnobs(FusedKernels):
    """``fused_kernels`` runs the thinker's and the talker's MoE experts as the grouped-GEMM
    Triton kernels (``mstar.layers.triton_moe``); the rest of both stays eager."""

    interpreted_on_cpu = True  # its kernel tests run them on the CPU under the interpreter

    attention_backend: Literal["torch", "triton"] = "torch"
    """The thinker's and the talker's paged-attention kernels: ``torch`` (the reference) or ``triton``."""

    codec_chunk_schedule: list[int] = Field(default_factory=lambda: [12, 13])
    """Codec frames of the first chunks code2wav decodes (the first audio waits for the first of
    them), before the chunks of ``codec_chunk_frames``; ``[]``: plain ``codec_chunk_frames`` chunks."""

    codec_chunk_frames: int = Field(25, ge=1)
    """Codec frames of every later chunk."""

    codec_left_context: int = Field(25, ge=0)
    """Earlier frames code2wav reads before a chunk (their samples are dropped)."""

    max_speech_frames: int = Field(2048, ge=1)
    """Codec frames (12.5 a second) one spoken answer may take at most."""

    talker_kv_pages: int = Field(1024, ge=1)
    """KV pages of the talker's own pool (``resources.kv_cache.page_size`` each); a request holds
    its talker prompt plus ``max_speech_frames`` positions while it speaks."""

    max_audio_seconds: float = Field(300.0, gt=0)
    """Seconds of one audio input at most; a longer one is a 400 naming its part."""

    max_upload_bytes: int = Field(64 << 20, ge=1)
    """Bytes of one uploaded audio file at most."""

    max_image_pixels: int = Field(1 << 24, ge=1)
    """Width x height of one decoded image at most."""

    max_media_per_request: int = Field(16, ge=0)
    """Audio clips, images and videos one request may hold."""

    video_fps: float = Field(2.0, gt=0)
    """Frames a second a video is sampled at; a temporal group of two frames then spans
    ``2 / video_fps`` seconds of positions (the processor's ``video_second_per_grid``)."""

    max_video_frames: int = Field(768, ge=2)
    """Sampled frames of one video at most (a longer video is sampled more sparsely)."""

    max_video_pixels: int = Field(1 << 28, ge=1)
    """Sampled frames x source width x height of one video at most; a larger one is a 400
    naming its part, refused before any frame is decoded."""

    default_voice: str | None = None
    """The voice of a request that names none (unset: the checkpoint's first speaker)."""

    @field_validator("codec_chunk_schedule")
    @classmethod
    def _schedule_positive(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError(f"every chunk needs at least one frame, got {value}")
        return value


class Qwen3OmniGenerateKnobs(GenerateKnobs):
    """``/generate``'s ``model_kwargs`` for Qwen3-Omni: a chat LLM's and the ``voice``."""

    voice: str | None = None
    """The speaker of the spoken answer (``output_modalities`` with ``audio``)."""
