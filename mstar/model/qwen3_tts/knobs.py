"""Qwen3-TTS's deployment knobs (the talker's budget, the codec's chunk ramp) and the options
of a speech request."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mstar.model.audio_watermark import AudioWatermarkKnobs
from mstar.model.decoding import SamplingKnobs
from mstar.model.knobs import CudaGraphs, FusedKernels, OverlapScheduling, require_cuda
from mstar.model.voice_cloning import ConditioningCacheKnobs


class Qwen3TTSKnobs(CudaGraphs, OverlapScheduling, FusedKernels):
    """The talker's fast path is opt-in: ``cuda_graphs`` (CUDA) replays a decode step's talker
    layers and its code predictor's frame (15 passes and their sampling) from graphs per batch
    bucket, with the Triton attention kernels; ``overlap_scheduling`` launches decode step k+1
    before step k's codes are read back. Eager is the reference; both give its codes.
    ``fused_kernels`` runs the talker's and the code predictor's layers as Llama's fused
    kernels (norms, RoPE with the cache write, and at decode row counts the GEMV kernels with
    the norm and SiLU * up folded in): the same sums in other orders, so logits agree to
    rounding, not bit for bit."""

    interpreted_on_cpu = True  # its test runs the kernels on the CPU under Triton's interpreter

    max_new_frames: int = Field(2048, ge=2)
    """Codec frames (12.5 a second) a request may speak when it does not send ``max_tokens``."""

    codec_chunk_schedule: list[int] = Field(default_factory=lambda: [1, 3, 8, 16])
    """New frames of the codec's first windows (the first audio waits for the first), before
    windows of ``codec_chunk_frames``: the reference's ramp."""

    codec_chunk_frames: int = Field(25, ge=1)
    """New frames of every later codec window."""

    codec_ramp: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: the windows follow ``codec_chunk_schedule`` then ``codec_chunk_frames``, whatever
    the load. ``adaptive``: each stream's next window is the largest of ``codec_window_sizes``
    (never above the fixed ramp's) that its measured rate keeps its player fed with, the first
    release held while even one frame cannot keep up (``mstar.model.qwen3_tts.ramp``)."""

    codec_window_sizes: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 25])
    """``adaptive``: the window sizes it picks from (with the ramp's and ``codec_chunk_frames``;
    none above it), few so that the codec's window graphs stay few."""

    codec_ramp_margin: float = Field(0.2, ge=0.0, le=4.0)
    """``adaptive``: the wait for a window's frames padded by this share of itself."""

    codec_ramp_typical_frames: int = Field(125, ge=1)
    """``adaptive``: the utterance (frames) a slow stream's first release holds for."""

    codec_left_context: int = Field(72, ge=0)
    """Frames already spoken that a window's transformer reads again (its sliding window)."""

    codec_cuda_graphs: bool = False
    """Replay the codec's windows from CUDA graphs per window shape and batch bucket (CUDA only;
    separate from ``cuda_graphs``, which is the talker's)."""

    codec_dtype: Literal["float32", "bfloat16"] = "float32"
    """The codec decoder's weights and activations. ``float32``, the reference's numerics, is the
    default; ``bfloat16`` roughly halves a window's GPU time (its conv stack is most of it), at
    bf16's rounding of the audio (the samples come out as float32 either way)."""

    default_voice: str | None = None
    """The built-in speaker of a request that names none (unset: the checkpoint's first)."""

    audio_watermark: AudioWatermarkKnobs = Field(default_factory=AudioWatermarkKnobs)
    """The opt-in AudioSeal watermark on the codec's audio, each request marked chunk by chunk."""

    def check(self, device: str) -> None:
        super().check(device)
        if self.codec_cuda_graphs:
            require_cuda("codec_cuda_graphs", device)

    @field_validator("codec_chunk_schedule", "codec_window_sizes")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError(f"every window needs at least one new frame, got {value}")
        return value


class Qwen3TTSBaseKnobs(Qwen3TTSKnobs, ConditioningCacheKnobs):
    """The base checkpoints' knobs: the others', the clip memo's bound and preset voices."""

    voices_dir: str | None = None
    """Preset voices: ``<name>.wav`` (or .flac, .ogg, .mp3), each a ``voice`` cloned from its
    x-vector as an uploaded clip is (``x_vector_only_mode``)."""


class Qwen3TTSSpeechKnobs(SamplingKnobs):
    """A speech request's ``model_kwargs``: sampling (codebook 0's; the code predictor samples
    with the reference's subtalker defaults, or greedily when ``temperature`` is 0), the
    budget and the text options."""

    max_tokens: int | None = Field(None, ge=2)
    """Codec frames at most (default: the deployment's ``max_new_frames``)."""

    language: str = "auto"
    """The language spoken (``auto``: detected by the model)."""

    instructions: str | None = None
    """A style instruction (1.7B CustomVoice) or the voice's description (VoiceDesign)."""

    non_streaming_mode: bool | None = None
    """True: the whole text goes into the prefill; False: one text token per frame (default:
    the checkpoint's variant decides: whole for CustomVoice and VoiceDesign)."""

    x_vector_only_mode: bool = False
    """Cloning from the clip's speaker vector alone, without its transcript."""
