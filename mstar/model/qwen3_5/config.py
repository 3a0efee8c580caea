"""Configuration of the Qwen3.5 hybrid language model (gated DeltaNet + gated attention)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class Qwen3_5Config:
    """The text model's hyper-parameters; names follow the checkpoint's ``text_config``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 256
    layer_types: list[str] = field(default_factory=list)  # empty: every 4th layer is full attention
    full_attention_interval: int = 4
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    eos_token_id: int | list[int] | None = None
    mamba_ssm_dtype: str | None = None  # dtype of the recurrent state (None: the model's)

    def __post_init__(self) -> None:
        if not self.layer_types:
            interval = self.full_attention_interval
            self.layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {LINEAR, FULL}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"unsupported hidden_act {self.hidden_act!r}")
        if self.rotary_dim % 2 or len(self.mrope_section) != 3:
            raise ValueError(f"need an even rotary dim (head_dim {self.head_dim} x partial_rotary_factor "
                             f"{self.partial_rotary_factor}) and three mrope_section entries, "
                             f"got {self.mrope_section}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3_5Config:
        """From a checkpoint's ``config.json``: the multimodal one (``text_config`` nested,
        ``tie_word_embeddings`` at the top) or a text-only one. Unknown keys are ignored."""
        text = dict(d.get("text_config") or d)
        if "text_config" in d and "tie_word_embeddings" in d:
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"unsupported rope_type {rope_type!r}")
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in rope and key in text:
                rope[key] = text[key]
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in names and v is not None}
        kwargs.pop("rope_theta", None)
        kwargs.pop("partial_rotary_factor", None)
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        if "partial_rotary_factor" in rope:
            kwargs["partial_rotary_factor"] = float(rope["partial_rotary_factor"])
        if "mrope_section" in rope:
            kwargs["mrope_section"] = list(rope["mrope_section"])
        if "eos_token_id" in text:
            kwargs["eos_token_id"] = text["eos_token_id"]
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A text-only ``config.json`` dict (``model_type: qwen3_5_text``)."""
        out: dict[str, Any] = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
        for f in fields(self):
            if f.name not in ("rope_theta", "partial_rotary_factor", "mrope_section", "full_attention_interval"):
                out[f.name] = getattr(self, f.name)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor,
                                  "mrope_section": list(self.mrope_section), "mrope_interleaved": True}
        return out


@dataclass
class Qwen3_5VisionConfig:
    """The ViT tower's hyper-parameters (the checkpoint's ``vision_config``) and the prompt
    token ids of the multimodal checkpoint (top level of its ``config.json``)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} must split into {self.num_heads} heads "
                             "whose size is a multiple of 4 (two rotary axes)")
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square grid")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise NotImplementedError(f"unsupported vision hidden_act {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3_5VisionConfig | None:
        """From a multimodal ``config.json``; None for a text-only checkpoint."""
        vision = d.get("vision_config")
        if not vision:
            return None
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in vision.items() if k in names and v is not None}
        rope = vision.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if d.get(key) is not None:
                kwargs[key] = d[key]
        return cls(**kwargs)
