"""Qwen3 decoders run as text encoders for diffusion conditioning (FLUX.2 klein, Z-Image)."""

from mstar.model.qwen3.config import Qwen3Config
from mstar.model.qwen3.encoder import Qwen3TextEncoder, attention_mask_4d
from mstar.model.qwen3.klein import (
    KLEIN_MAX_LENGTH,
    KLEIN_TAP_LAYERS,
    Z_IMAGE_MAX_LENGTH,
    Z_IMAGE_TAP_LAYER,
    klein_prompt_embeds,
    text_ids,
    z_image_caption_embeds,
)

__all__ = [
    "KLEIN_MAX_LENGTH",
    "KLEIN_TAP_LAYERS",
    "Z_IMAGE_MAX_LENGTH",
    "Z_IMAGE_TAP_LAYER",
    "Qwen3Config",
    "Qwen3TextEncoder",
    "attention_mask_4d",
    "klein_prompt_embeds",
    "text_ids",
    "z_image_caption_embeds",
]
