"""Configuration of Llama-architecture decoders (SmolLM2, Orpheus, Llama 2/3, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.model.hf_config import config_dict, config_kwargs, normalize_rope_scaling


@dataclass
class LlamaConfig:
    """The hyper-parameters of a Llama decoder; names follow Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: same as num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"unsupported hidden_act {self.hidden_act!r}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "llama3":
            self.rope_scaling.setdefault(
                "original_max_position_embeddings", self.max_position_embeddings
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` dict (unknown keys are ignored).

        RoPE settings are read from ``rope_parameters`` (transformers 5) or from the older
        ``rope_theta`` / ``rope_scaling`` pair.
        """
        return cls(**config_kwargs(cls, d, nullable={"bos_token_id", "eos_token_id"}))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict, RoPE as transformers 5 ``rope_parameters``."""
        return config_dict(self, "LlamaForCausalLM", "llama")
