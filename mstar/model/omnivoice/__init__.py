"""OmniVoice (k2-fsa/OmniVoice): zero-shot multilingual TTS on a masked-diffusion canvas."""

from mstar.model.omnivoice.backbone import OmniVoiceBackbone
from mstar.model.omnivoice.canvas import Canvas, CanvasPrompt, denoise
from mstar.model.omnivoice.config import CodecConfig, OmniVoiceConfig, tiny_config
from mstar.model.omnivoice.modeling import Codec, OmniVoiceModel
from mstar.model.omnivoice.schedule import UnmaskKnobs, unmask_counts, unmask_step

__all__ = [
    "Canvas",
    "CanvasPrompt",
    "CodecConfig",
    "Codec",
    "OmniVoiceBackbone",
    "OmniVoiceConfig",
    "OmniVoiceModel",
    "UnmaskKnobs",
    "denoise",
    "tiny_config",
    "unmask_counts",
    "unmask_step",
]
