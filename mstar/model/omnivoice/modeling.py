"""The networks of OmniVoice together: the canvas backbone and the codec (both directions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.omnivoice.backbone import OmniVoiceBackbone
from mstar.model.omnivoice.codec import AcousticDecoder, ResidualQuantizer
from mstar.model.omnivoice.codec_encoder import (
    AcousticEncoder,
    SemanticEncoder,
    hubert,
    nearest_codes,
    semantic_features,
)
from mstar.model.omnivoice.config import CodecConfig, OmniVoiceConfig


class Codec(nn.Module):
    """The Higgs Audio v2 tokenizer: ``decode`` codes ``[B, C, T]`` -> ``[B, T * hop]`` samples
    at ``sample_rate``; ``encode`` a clip -> codes (``codec.py``, ``codec_encoder.py``)."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = ResidualQuantizer(config)
        self.fc2 = nn.Linear(config.hidden_size, config.acoustic_hidden_size)
        self.acoustic_decoder = AcousticDecoder(config)
        self.acoustic_encoder = AcousticEncoder(config)
        self.encoder_semantic = SemanticEncoder(config)
        self.semantic_model = hubert(config)
        self.fc = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decode(codes)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        latent = self.fc2(self.quantizer.decode(codes)).transpose(1, 2)
        return self.acoustic_decoder(latent)[:, 0]

    def encode(self, wave: torch.Tensor, wave_semantic: torch.Tensor, rows: int) -> torch.Tensor:
        """Codes ``[B, rows, T]`` of ``wave`` ``[B, samples]`` at ``sample_rate``, given the same
        clip at ``semantic_sample_rate`` (``wave_semantic``)."""
        semantic = semantic_features(self.semantic_model, wave_semantic, self.config.semantic_stride)
        semantic = self.encoder_semantic(semantic.transpose(1, 2))
        if self.acoustic_encoder.frames(wave.shape[-1]) != semantic.shape[-1]:
            half = self.config.hop_length // 2
            wave = F.pad(wave, (half, half))
        acoustic = self.acoustic_encoder(wave[:, None])
        residual = self.fc(torch.cat([acoustic, semantic], dim=1).transpose(1, 2))  # [B, T, hidden]
        codes = []
        for q in self.quantizer.quantizers[:rows]:
            ids = nearest_codes(q.project_in(residual), q.codebook.embed)
            residual = residual - q(ids)
            codes.append(ids)
        return torch.stack(codes, dim=1)


class OmniVoiceModel(nn.Module):
    """``backbone`` (the release's ``model.safetensors``) and ``codec`` (its
    ``audio_tokenizer/``); either made from ``config`` unless given (the checkpoint builds
    them apart: the backbone in the deployment's dtype, the codec in float32)."""

    def __init__(self, config: OmniVoiceConfig, backbone: OmniVoiceBackbone | None = None,
                 codec: Codec | None = None) -> None:
        super().__init__()
        self.config = config
        self.backbone = backbone if backbone is not None else OmniVoiceBackbone(config)
        self.codec = codec if codec is not None else Codec(config.codec)
