"""Configuration of Qwen3 dense decoders (Qwen3-0.6B ... Qwen3-32B).

Defaults follow ``transformers.Qwen3Config`` so that a ``config.json`` omitting a key means the
same thing here as there (notably ``head_dim`` defaults to 128, not ``hidden / heads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.model.hf_config import config_dict, config_kwargs, normalize_rope_scaling


@dataclass
class Qwen3Config:
    """The hyper-parameters of a Qwen3 decoder; names follow Hugging Face ``config.json``."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: same as num_attention_heads
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None: plain RoPE
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_sliding_window: bool = False
    hidden_act: str = "silu"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"unsupported hidden_act {self.hidden_act!r}")
        if self.use_sliding_window:
            raise NotImplementedError("Qwen3 sliding-window attention is not supported")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)

    @property
    def num_kv_heads(self) -> int:
        """``num_key_value_heads`` as a plain ``int`` (resolved in ``__post_init__``)."""
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3Config:
        """Build from a Hugging Face ``config.json`` dict (unknown keys are ignored).

        RoPE settings are read from ``rope_parameters`` (transformers 5) or from the older
        ``rope_theta`` / ``rope_scaling`` pair.
        """
        return cls(**config_kwargs(cls, d, nullable={"pad_token_id", "bos_token_id", "eos_token_id"}))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict, RoPE as transformers 5 ``rope_parameters``."""
        return config_dict(self, "Qwen3ForCausalLM", "qwen3")
