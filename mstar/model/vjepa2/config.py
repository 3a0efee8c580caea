"""V-JEPA 2's dimensions.

``vjepa2`` reads them from the Hugging Face ``config.json`` (``VJEPA2Config``: ``hidden_size``,
``pred_*``...). ``vjepa2_ac`` ships as one PyTorch file with no config, so its dimensions are the
released ViT-g encoder and action-conditioned predictor (``VJEPA2ACConfig.released``); a
``config.json`` beside the weights overrides them (the tests write tiny ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class EncoderConfig:
    """The ViT: ``tubelet_size`` frames x ``patch_size``^2 pixels per token, square
    ``crop_size`` frames (the 3D rotary positions assume that grid)."""

    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    patch_size: int = 16
    tubelet_size: int = 2
    crop_size: int = 256
    frames_per_clip: int = 64
    in_chans: int = 3
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True

    @property
    def grid(self) -> int:
        """Tokens along a side of one frame."""
        return self.crop_size // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        return self.grid * self.grid


@dataclass(frozen=True)
class PredictorConfig:
    """The masked predictor (``vjepa2``): ``num_mask_tokens`` learnt target tokens."""

    hidden_size: int = 384
    num_layers: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    num_mask_tokens: int = 10


@dataclass(frozen=True)
class ACPredictorConfig:
    """The action-conditioned predictor (``vjepa2_ac``): per time step an action token, a state
    token (``action_dim`` each) and, with ``use_extrinsics``, a camera token, before the frame's
    tokens; frame-causal attention."""

    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    action_dim: int = 7
    use_extrinsics: bool = False

    @property
    def cond_tokens(self) -> int:
        return 3 if self.use_extrinsics else 2


@dataclass(frozen=True)
class VJEPA2Config:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VJEPA2Config:
        """From the released ``config.json`` (``model_type: vjepa2``)."""
        patch = raw.get("patch_size", 16)
        encoder = EncoderConfig(
            hidden_size=raw.get("hidden_size", 1024), num_layers=raw.get("num_hidden_layers", 24),
            num_heads=raw.get("num_attention_heads", 16), mlp_ratio=float(raw.get("mlp_ratio", 4.0)),
            patch_size=patch if isinstance(patch, int) else int(patch[0]),
            tubelet_size=raw.get("tubelet_size", 2), crop_size=raw.get("crop_size", 256),
            frames_per_clip=raw.get("frames_per_clip", 64), in_chans=raw.get("in_chans", 3),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-6), qkv_bias=raw.get("qkv_bias", True))
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (gelu only)")
        predictor = PredictorConfig(
            hidden_size=raw.get("pred_hidden_size", 384), num_layers=raw.get("pred_num_hidden_layers", 12),
            num_heads=raw.get("pred_num_attention_heads", 12), mlp_ratio=float(raw.get("pred_mlp_ratio", 4.0)),
            num_mask_tokens=raw.get("pred_num_mask_tokens", 10))
        return cls(encoder, predictor)


@dataclass(frozen=True)
class VJEPA2ACConfig:
    encoder: EncoderConfig
    predictor: ACPredictorConfig

    @classmethod
    def released(cls) -> VJEPA2ACConfig:
        """``vjepa2-ac-vitg``: the ViT-g/16 encoder at 256 px and the 24-layer, 1024-wide
        predictor over 7-dim actions and states."""
        return cls(EncoderConfig(hidden_size=1408, num_layers=40, num_heads=22, mlp_ratio=48 / 11),
                   ACPredictorConfig())

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> VJEPA2ACConfig:
        """The released dimensions with ``raw["encoder"]`` / ``raw["predictor"]`` laid over them
        (field names as in ``EncoderConfig`` / ``ACPredictorConfig``); an unknown key is an error."""
        base = cls.released()
        parts = {}
        for name, part in (("encoder", base.encoder), ("predictor", base.predictor)):
            given = dict(raw.get(name, {}))
            known = {f.name for f in fields(part)}
            if unknown := sorted(set(given) - known):
                raise ValueError(f"config.json: {name}.{unknown[0]} is not a field (known: {sorted(known)})")
            parts[name] = replace(part, **given)
        if unknown := sorted(set(raw) - {"encoder", "predictor"}):
            raise ValueError(f"config.json: unknown key {unknown[0]!r} (encoder, predictor)")
        return cls(parts["encoder"], parts["predictor"])
