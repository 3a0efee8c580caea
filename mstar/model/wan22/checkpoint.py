"""Where Wan2.2-TI2V-5B's weights and configs come from: a diffusers-layout directory (or Hugging
Face id) with the UMT5 ``text_encoder`` and its ``tokenizer``, the ``transformer`` (the DiT), the
``vae`` and the ``scheduler``. Only the dense TI2V-5B variant is served: a two-DiT checkpoint
(the A14B models' ``transformer_2``) or a Wan2.1 one is refused by name."""

from __future__ import annotations

from mstar.diffusion.unipc import UniPC
from mstar.model.diffusers_checkpoint import DiffusersCheckpoint
from mstar.model.wan22.config import WanTransformerConfig
from mstar.model.wan22.text import WanText
from mstar.model.wan22.umt5 import UMT5Config
from mstar.model.wan22.vae import WanVAEConfig


class WanCheckpoint(DiffusersCheckpoint):
    def check_variant(self) -> None:
        """Refuse what is not Wan2.2-TI2V-5B, naming what gives it away."""
        index = self.read_json("model_index.json")
        if index.get("transformer_2") not in (None, [None, None]) or index.get("boundary_ratio") is not None:
            raise ValueError("this is a two-DiT Wan2.2 checkpoint (A14B: transformer_2 / boundary_ratio); "
                             "wan22 serves only the dense Wan2.2-TI2V-5B")
        if index.get("image_encoder") not in (None, [None, None]):
            raise ValueError("this Wan checkpoint has a CLIP image_encoder (Wan2.1 I2V); wan22 serves only "
                             "Wan2.2-TI2V-5B")
        if index.get("expand_timesteps") is False:
            raise ValueError("model_index.json: expand_timesteps is false; Wan2.2-TI2V-5B needs it true")

    def text(self) -> WanText:
        return WanText.from_directory(self.root)

    def text_config(self) -> UMT5Config:
        return UMT5Config.from_dict(self.read_json("text_encoder", "config.json"))

    def transformer_config(self) -> WanTransformerConfig:
        return WanTransformerConfig.from_dict(self.read_json("transformer", "config.json"))

    def vae_config(self) -> WanVAEConfig:
        config = WanVAEConfig.from_dict(self.read_json("vae", "config.json"))
        if not config.residual:
            raise ValueError("vae config: is_residual is false (the Wan2.1 VAE); wan22 serves only the Wan2.2 VAE")
        return config

    def schedule(self) -> UniPC:
        return UniPC.from_config(self.read_json("scheduler", "scheduler_config.json"))
