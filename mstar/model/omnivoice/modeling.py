"""The two networks of OmniVoice together: the canvas backbone and the codec decoder."""

from __future__ import annotations

import torch
from torch import nn

from mstar.model.omnivoice.backbone import OmniVoiceBackbone
from mstar.model.omnivoice.codec import CodecDecoder
from mstar.model.omnivoice.config import OmniVoiceConfig


class OmniVoiceModel(nn.Module):
    """``backbone`` (the release's ``model.safetensors``) and ``codec`` (its
    ``audio_tokenizer/``, decoder half)."""

    def __init__(self, config: OmniVoiceConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = OmniVoiceBackbone(config)
        self.codec = CodecDecoder(config.codec)

    @torch.no_grad()
    def init_codebooks(self, seed: int) -> None:
        """Seeded codewords for dummy weights (buffers, which dummy filling leaves at zero, so
        every code would otherwise decode to the same frame)."""
        g = torch.Generator().manual_seed(seed)
        for q in self.codec.quantizer.quantizers:
            embed = q.codebook.embed
            embed.copy_(torch.randn(embed.shape, generator=g).to(embed))
