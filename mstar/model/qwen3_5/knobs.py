"""Qwen3.5's deployment knobs (the decoder's attention kernels, the media budgets and
processor overrides) and the options of a ``/generate`` request."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import Field, field_validator

from mstar.model.chat import GenerateKnobs
from mstar.model.knobs import Knobs
from mstar.model.qwen3_5.media import MediaLimits
from mstar.model.qwen3_5.processor import ImageProcessing, VideoProcessing

_LIMITS = MediaLimits()


def _known(value: dict[str, Any], settings: type) -> dict[str, Any]:
    names = {f.name for f in fields(settings)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(names)}")
    return value


class Qwen3_5Knobs(Knobs):
    attention_backend: Literal["torch", "triton"] = "torch"
    """The decoder's paged-attention kernels: ``torch`` (the reference) or ``triton``."""

    image_processor: dict[str, Any] = Field(default_factory=dict)
    """Image processor settings over the checkpoint's (``ImageProcessing``'s fields)."""

    video_processor: dict[str, Any] = Field(default_factory=dict)
    """Video processor settings over the checkpoint's (``VideoProcessing``'s fields)."""

    max_image_pixels: int = Field(_LIMITS.max_image_pixels, ge=1)
    """Width x height of one decoded image at most; a larger one is a 400."""

    max_video_pixels: int = Field(_LIMITS.max_video_pixels, ge=1)
    """Sampled frames x width x height of one video at most."""

    max_media_per_request: int = Field(_LIMITS.max_media, ge=0)
    """Images and videos one request may hold."""

    @field_validator("image_processor")
    @classmethod
    def _image_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _known(value, ImageProcessing)

    @field_validator("video_processor")
    @classmethod
    def _video_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _known(value, VideoProcessing)

    @property
    def media_limits(self) -> MediaLimits:
        return MediaLimits(self.max_image_pixels, self.max_video_pixels, self.max_media_per_request)


class Qwen3_5GenerateKnobs(GenerateKnobs):
    """``/generate``'s ``model_kwargs`` for Qwen3.5: a chat LLM's, and the template's switch."""

    enable_thinking: bool | None = None
    """The chat template's thinking switch (None: the template's default)."""
