"""The FLUX.1 VAE that Z-Image uses (images <-> 16-channel latents at 1/8 resolution).

``ZImageVAE`` mirrors diffusers' ``AutoencoderKL``: parameter names equal its state dict keys, so a
checkpoint's ``vae/`` folder loads by name. The encoder / decoder networks are the same as the
FLUX.2 VAE's and are built from ``mstar.model.flux2.vae``; what differs is around them: no batch
norm of the latents, the (FLUX.1: absent) quant convolutions optional, and the DiT's latents are
the VAE latents affinely normalised, ``(z - shift_factor) * scaling_factor``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.model.flux2.vae import Flux2VAEConfig, _Decoder, _Encoder

__all__ = ["ZImageVAE", "ZImageVAEConfig"]

# diffusers' AutoencoderKL constructor defaults, for keys a config.json leaves out.
_AUTOENCODER_KL_DEFAULTS: dict[str, Any] = {
    "block_out_channels": (64,), "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 32,
    "use_quant_conv": True, "use_post_quant_conv": True, "mid_block_add_attention": True,
}


@dataclass(frozen=True)
class ZImageVAEConfig:
    """The network shape (shared with FLUX.2's VAE) plus the latent normalisation."""

    net: Flux2VAEConfig
    scaling_factor: float = 0.3611  # FLUX.1's values
    shift_factor: float = 0.1159

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ZImageVAEConfig:
        """Build from a diffusers ``AutoencoderKL`` ``config.json`` dict."""
        if data.get("latents_mean") is not None or data.get("latents_std") is not None:
            raise ValueError("per-channel latents_mean / latents_std are not supported for this VAE")
        net = Flux2VAEConfig.from_dict({**_AUTOENCODER_KL_DEFAULTS, **data})
        return cls(net, float(data.get("scaling_factor", 0.18215)), float(data.get("shift_factor") or 0.0))

    @property
    def scale_factor(self) -> int:
        """Pixels per latent cell along each side (8 for FLUX.1)."""
        return self.net.scale_factor


class ZImageVAE(nn.Module):
    """Autoencoder with diffusers ``AutoencoderKL`` parameter names."""

    def __init__(self, config: ZImageVAEConfig) -> None:
        super().__init__()
        self.config = config
        net, lc = config.net, config.net.latent_channels
        self.encoder = _Encoder(net)
        self.decoder = _Decoder(net)
        self.quant_conv = nn.Conv2d(2 * lc, 2 * lc, 1) if net.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(lc, lc, 1) if net.use_post_quant_conv else None

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in ``[-1, 1]`` -> posterior mean ``[B, C, H/8, W/8]``."""
        moments = self.encoder(images)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return moments[:, : self.config.net.latent_channels]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents ``[B, C, h, w]`` -> images ``[B, 3, 8h, 8w]`` (nominally in ``[-1, 1]``)."""
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the DiT's latents ``(z - shift) * scale``."""
        return (latents - self.config.shift_factor) * self.config.scaling_factor

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT's latents -> VAE latents ``z / scale + shift`` (the pipeline's order of ops)."""
        return latents / self.config.scaling_factor + self.config.shift_factor
