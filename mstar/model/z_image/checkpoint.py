"""Where Z-Image's weights and configs come from: a diffusers-layout directory (or Hugging
Face id) with the Qwen3 ``text_encoder`` and its ``tokenizer``, the ``transformer`` (the DiT),
the ``vae`` and the ``scheduler`` (the Turbo schedule when the folder has none)."""

from __future__ import annotations

from mstar.model.diffusers_checkpoint import DiffusersCheckpoint
from mstar.model.z_image.config import ZImageTransformerConfig
from mstar.model.z_image.schedule import TURBO_SCHEDULER, ZImageSchedule
from mstar.model.z_image.text import ZImageText
from mstar.model.z_image.vae import ZImageVAEConfig


class ZImageCheckpoint(DiffusersCheckpoint):
    def text(self) -> ZImageText:
        return ZImageText.from_directory(self.root)

    def transformer_config(self) -> ZImageTransformerConfig:
        return ZImageTransformerConfig.from_dict(self.read_json("transformer", "config.json"))

    def latent_channels(self) -> int:
        return int(self.read_json("transformer", "config.json").get("in_channels", 16))

    def vae_config(self) -> ZImageVAEConfig:
        return ZImageVAEConfig.from_dict(self.read_json("vae", "config.json"))

    def schedule(self) -> ZImageSchedule:
        scheduler = self.root / "scheduler" / "scheduler_config.json"
        return ZImageSchedule.from_config(self.read_json("scheduler", "scheduler_config.json")
                                          if scheduler.exists() else TURBO_SCHEDULER)
