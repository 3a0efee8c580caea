"""BAGEL's deployment knobs (understanding side: the decoder's attention kernels and the
image budgets)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mstar.model.knobs import Knobs


class BagelKnobs(Knobs):
    attention_backend: Literal["torch", "triton"] = "torch"
    """The paged-attention kernels of the decoder and of the image generator (its contexts and
    denoise steps): ``torch`` (the reference) or ``triton``."""

    max_images_per_request: int = Field(8, ge=0)
    """Images one chat request may hold; more is a 400 naming the first image over."""

    max_image_pixels: int = Field(1 << 26, ge=1)
    """Width x height of one decoded input image at most (before BAGEL's resize); larger is a 400."""

    vit_resize: list[int] = Field(default_factory=lambda: [980, 224])
    """An input image as the tower reads it: (longest side at most, shortest side at least) in
    pixels, sides rounded to the patch size (BAGEL's inference code: 980 and 224)."""

    vae_resize: list[int] = Field(default_factory=lambda: [1024, 512])
    """The resize BAGEL's inference code applies first to every input image, understanding
    included: (longest side at most, shortest side at least), sides multiples of 16."""

    generator_kv_pages: int = Field(4096, ge=1)
    """KV pages of the image generator's own pool (``resources.kv_cache.page_size`` tokens
    each): an image request holds three contexts (full, without its text, without its input
    image), each with room for its latent tokens (4096 for 1024 x 1024) past it; a 1024 x 1024
    edit takes about 30k tokens (BAGEL-7B: 56 KiB each in bfloat16)."""

    @field_validator("vit_resize", "vae_resize")
    @classmethod
    def _sizes(cls, value: list[int]) -> list[int]:
        if len(value) != 2 or not 0 < value[1] <= value[0]:
            raise ValueError("must be [longest side at most, shortest side at least], 0 < shortest <= longest")
        return value
