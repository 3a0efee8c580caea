"""Where LTX-2.5's weights and configs come from: a diffusers-layout directory (or Hugging Face
id, ``Lightricks/LTX-2.5-Diffusers``) with ``text_encoder`` (Gemma 4) and ``tokenizer``,
``connectors``, ``transformer``, ``vae``, ``audio_vae``, ``vocoder`` and ``scheduler``.

What we load is a subset of some folders, and each such folder says so in a name map (so the
coverage check still holds both ways on the rest): the video and audio VAEs' encoders (text-to-
video never encodes), and everything of the Gemma checkpoint but its text model (the image and
audio towers, the tied LM head).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mstar.model.diffusers_checkpoint import DiffusersCheckpoint
from mstar.model.ltx2_5.audio_vae import LtxAudioVaeConfig
from mstar.model.ltx2_5.config import LtxTransformerConfig
from mstar.model.ltx2_5.connectors import LtxConnectorsConfig
from mstar.model.ltx2_5.denoise import LtxSchedule
from mstar.model.ltx2_5.gemma import GemmaTextConfig
from mstar.model.ltx2_5.video_vae import LtxVideoVaeConfig

GEMMA_TEXT_PREFIX = "model.language_model."
GEMMA_TEXT_TYPES = ("gemma4_unified_text", "gemma4_text")


def skip_encoder(name: str) -> str | None:
    """A VAE checkpoint name -> ours (None for the encoder we do not build)."""
    return None if name.startswith("encoder.") else name


def gemma_text_only(name: str) -> str | None:
    """A Gemma 4 checkpoint name -> the text model's (None for the towers and the LM head)."""
    return name[len(GEMMA_TEXT_PREFIX):] if name.startswith(GEMMA_TEXT_PREFIX) else None


NAME_MAPS: dict[str, Callable[[str], str | None]] = {
    "vae": skip_encoder, "audio_vae": skip_encoder, "text_encoder": gemma_text_only}


class LtxCheckpoint(DiffusersCheckpoint):
    def check_variant(self) -> None:
        """Refuse a checkpoint this family cannot serve, naming what gives it away."""
        index = self.read_json("model_index.json")
        if index.get("_class_name") not in ("LTX2Pipeline", None):
            raise ValueError(f"model_index.json: {index['_class_name']} is not an LTX2Pipeline checkpoint")
        text = self.read_json("text_encoder", "config.json")
        kind = text.get("text_config", text).get("model_type")
        if kind not in GEMMA_TEXT_TYPES:
            raise ValueError(f"text_encoder: {kind!r} is not a Gemma 4 text model (ltx2_5 serves LTX-2.5; the "
                             "Gemma 3 encoder of LTX-2.0/2.3 is not ported)")
        vocoder = self.read_json("vocoder", "config.json").get("_class_name")
        if vocoder != "LTX2VocoderWithBWE":
            raise ValueError(f"vocoder: {vocoder!r} does not give 48 kHz audio (LTX2VocoderWithBWE expected)")

    def text_config(self) -> GemmaTextConfig:
        return GemmaTextConfig.from_dict(self.read_json("text_encoder", "config.json"))

    def connectors_config(self) -> LtxConnectorsConfig:
        return LtxConnectorsConfig.from_dict(self.read_json("connectors", "config.json"))

    def transformer_config(self) -> LtxTransformerConfig:
        return LtxTransformerConfig.from_dict(self.read_json("transformer", "config.json"))

    def vae_config(self) -> LtxVideoVaeConfig:
        return LtxVideoVaeConfig.from_dict(self.read_json("vae", "config.json"))

    def audio_vae_config(self) -> LtxAudioVaeConfig:
        return LtxAudioVaeConfig.from_dict(self.read_json("audio_vae", "config.json"))

    def vocoder_config(self) -> dict[str, Any]:
        return self.read_json("vocoder", "config.json")

    def schedule(self) -> LtxSchedule:
        return LtxSchedule.from_config(self.read_json("scheduler", "scheduler_config.json"))

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.root / "tokenizer")
