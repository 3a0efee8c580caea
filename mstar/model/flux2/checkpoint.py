"""Where FLUX.2 [klein]'s weights and configs come from: a diffusers-layout directory (or
Hugging Face id) with the Qwen3 ``text_encoder`` and its ``tokenizer``, the ``transformer``
(the DiT) and the ``vae``."""

from __future__ import annotations

from mstar.model.diffusers_checkpoint import DiffusersCheckpoint
from mstar.model.flux2.config import Flux2TransformerConfig
from mstar.model.flux2.text import KleinText
from mstar.model.flux2.vae import Flux2VAEConfig


class Flux2Checkpoint(DiffusersCheckpoint):
    def text(self) -> KleinText:
        return KleinText.from_directory(self.root)

    def transformer_config(self) -> Flux2TransformerConfig:
        return Flux2TransformerConfig.from_dict(self.read_json("transformer", "config.json"))

    def vae_config(self) -> Flux2VAEConfig:
        return Flux2VAEConfig.from_dict(self.read_json("vae", "config.json"))
