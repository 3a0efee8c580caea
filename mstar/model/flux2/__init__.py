"""FLUX.2 diffusion transformer (the denoiser of FLUX.2 [dev] / [klein] image generation)."""

from mstar.model.flux2.config import PRESETS, Flux2TransformerConfig
from mstar.model.flux2.rope import Flux2RotaryEmbedding, rope_cos_sin
from mstar.model.flux2.transformer import (
    Flux2DoubleStreamBlock,
    Flux2SingleStreamBlock,
    Flux2Transformer,
    attention,
)

__all__ = [
    "PRESETS",
    "Flux2DoubleStreamBlock",
    "Flux2RotaryEmbedding",
    "Flux2SingleStreamBlock",
    "Flux2Transformer",
    "Flux2TransformerConfig",
    "attention",
    "rope_cos_sin",
]
