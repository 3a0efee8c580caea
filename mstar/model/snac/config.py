"""Configuration of the SNAC neural audio codec (multi-scale residual VQ + conv decoder).

Field names mirror the ``config.json`` of the reference ``snac`` package (and the arguments of
``snac.SNAC``), so ``SNAC(**cfg.to_dict())`` builds the matching reference model. Defaults are
those of ``hubertsiuzdak/snac_24khz``, the codec Orpheus TTS decodes with.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class SnacConfig:
    """Hyper-parameters of a SNAC codec; names follow the reference ``config.json``."""

    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: list[int] = field(default_factory=lambda: [2, 4, 8, 8])
    decoder_dim: int = 1024
    decoder_rates: list[int] = field(default_factory=lambda: [8, 8, 4, 2])
    attn_window_size: int | None = None  # None: no local attention in the decoder
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: list[int] = field(default_factory=lambda: [4, 2, 1])  # coarse -> fine
    noise: bool = True  # decoder blocks carry a NoiseBlock
    depthwise: bool = True
    latent_dim: int | None = None  # None: encoder_dim * 2 ** len(encoder_rates)

    def __post_init__(self) -> None:
        self.encoder_rates = [int(r) for r in self.encoder_rates]
        self.decoder_rates = [int(r) for r in self.decoder_rates]
        self.vq_strides = [int(s) for s in self.vq_strides]
        if not self.decoder_rates or not self.vq_strides:
            raise ValueError("decoder_rates and vq_strides must not be empty")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError("decoder_dim must be divisible by 2 ** len(decoder_rates)")
        if self.hop_length != math.prod(self.decoder_rates):
            raise ValueError("prod(encoder_rates) must equal prod(decoder_rates)")

    @property
    def resolved_latent_dim(self) -> int:
        """Channels of the quantized latent fed to the decoder."""
        if self.latent_dim is not None:
            return self.latent_dim
        return self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        """Audio samples per latent time step."""
        return math.prod(self.encoder_rates)

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per code of the coarsest level (one Orpheus 7-token frame at 24 kHz)."""
        return self.hop_length * self.vq_strides[0]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SnacConfig:
        """Build from a reference ``config.json`` dict; unknown keys are rejected, as
        ``snac.SNAC(**config)`` would reject them."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown SNAC config keys: {unknown}")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> SnacConfig:
        """Read a reference ``config.json``."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict (also valid keyword arguments for ``snac.SNAC``)."""
        return asdict(self)
