"""Pi0.5's dimensions, read from a lerobot ``config.json`` (``"type": "pi05"``).

The released config names its two Gemmas by variant (``paligemma_variant: gemma_2b``,
``action_expert_variant: gemma_300m``) and leaves SigLIP at PaliGemma's so400m/14 at
``image_resolution``; the tables below give their sizes. A config may instead spell the sizes
out under ``"dims"`` (``{"vision": {...}, "text": {...}, "expert": {...}}``): the tiny
checkpoints of the tests do, and nothing released does.

The robot's own sizes come from the config's features: ``input_features`` lists the cameras
(``observation.images.*``, type VISUAL) and the state (``observation.state``), and
``output_features`` the action; their shapes are the embodiment's (the model works on vectors
zero-padded to ``max_state_dim`` / ``max_action_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class GemmaDims:
    """One Gemma decoder: the PaliGemma language model or the action expert."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class SiglipDims:
    """The SigLIP vision tower (no pooling head: every patch is a token)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    image_size: int = 224
    patch_size: int = 14
    layer_norm_eps: float = 1e-6

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


GEMMA_VARIANTS = {
    "gemma_2b": GemmaDims(2048, 16384, 18, 8, 1, 256),
    "gemma_300m": GemmaDims(1024, 4096, 18, 8, 1, 256),
}

PALIGEMMA_VOCAB = 257152  # Gemma's 256k tokens plus PaliGemma's location and segment tokens


@dataclass(frozen=True)
class Pi05Config:
    vision: SiglipDims
    text: GemmaDims
    expert: GemmaDims
    vocab_size: int = PALIGEMMA_VOCAB
    chunk_size: int = 50
    max_action_dim: int = 32
    max_state_dim: int = 32
    num_inference_steps: int = 10
    min_period: float = 4e-3
    max_period: float = 4.0
    tokenizer_max_length: int = 200
    cameras: tuple[str, ...] = ("observation.images.base_0_rgb",)
    state_dim: int = 32
    action_dim: int = 32
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.text.num_kv_heads, self.text.head_dim) != (self.expert.num_kv_heads, self.expert.head_dim):
            raise ValueError("the action expert attends to the language model's keys: its num_kv_heads and "
                             "head_dim must equal the language model's")
        if self.expert.hidden_size % 2:
            raise ValueError(f"expert hidden_size {self.expert.hidden_size} must be even (sin/cos time embedding)")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            raise ValueError(f"state_dim {self.state_dim} / action_dim {self.action_dim} exceed max_state_dim "
                             f"{self.max_state_dim} / max_action_dim {self.max_action_dim}")

    @property
    def tokens_per_image(self) -> int:
        return self.vision.tokens_per_image

    def with_(self, **changes: Any) -> Pi05Config:
        return replace(self, **changes)

    @classmethod
    def from_lerobot(cls, data: dict[str, Any]) -> Pi05Config:
        """From a lerobot ``config.json`` dict."""
        if data.get("type", "pi05") != "pi05":
            raise ValueError(f"not a Pi0.5 config: type {data.get('type')!r}")
        dims = data.get("dims", {})
        resolution = data.get("image_resolution", [224, 224])
        if resolution[0] != resolution[1]:
            raise ValueError(f"image_resolution {resolution} is not square")
        vision = SiglipDims(**{"image_size": int(resolution[0]), **dims.get("vision", {})})
        text = _gemma(dims.get("text"), data.get("paligemma_variant", "gemma_2b"))
        expert = _gemma(dims.get("expert"), data.get("action_expert_variant", "gemma_300m"))
        inputs = data.get("input_features") or {}
        outputs = data.get("output_features") or {}
        cameras = tuple(k for k, f in inputs.items() if f.get("type") == "VISUAL")  # the policy's order
        max_state = int(data.get("max_state_dim", 32))
        max_action = int(data.get("max_action_dim", 32))
        state = inputs.get("observation.state", {}).get("shape", [max_state])
        action = outputs.get("action", {}).get("shape", [max_action])
        return cls(
            vision=vision, text=text, expert=expert,
            vocab_size=int(dims.get("vocab_size", PALIGEMMA_VOCAB)),
            chunk_size=int(data.get("chunk_size", 50)),
            max_action_dim=max_action, max_state_dim=max_state,
            num_inference_steps=int(data.get("num_inference_steps", 10)),
            min_period=float(data.get("min_period", 4e-3)), max_period=float(data.get("max_period", 4.0)),
            tokenizer_max_length=int(data.get("tokenizer_max_length", 200)),
            cameras=cameras or cls.cameras, state_dim=int(state[-1]), action_dim=int(action[-1]),
            extra=data,
        )


def _gemma(explicit: dict[str, Any] | None, variant: str) -> GemmaDims:
    if explicit:
        return GemmaDims(**explicit)
    if variant not in GEMMA_VARIANTS:
        raise ValueError(f"unknown Gemma variant {variant!r}; known: {sorted(GEMMA_VARIANTS)}")
    return GEMMA_VARIANTS[variant]
