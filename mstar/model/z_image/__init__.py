"""Z-Image(-Turbo): a single-stream DiT over [image, caption] tokens, a Qwen3 caption encoder
and the FLUX.1 VAE."""

from mstar.model.z_image.config import ZImageTransformerConfig
from mstar.model.z_image.schedule import ZImageSchedule
from mstar.model.z_image.transformer import ZImageBlock, ZImageTransformer
from mstar.model.z_image.vae import ZImageVAE, ZImageVAEConfig

__all__ = ["ZImageBlock", "ZImageSchedule", "ZImageTransformer", "ZImageTransformerConfig", "ZImageVAE",
           "ZImageVAEConfig"]
