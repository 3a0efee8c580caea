"""Configuration of Qwen3-Omni's thinker text decoder (the 30B-A3B MoE LLM).

Defaults follow ``transformers``' ``Qwen3OmniMoeTextConfig`` so that a ``config.json`` omitting
a key means the same here as there; ``from_hf_dict`` reads the text part of a whole Omni
config, of a thinker config or of a bare text config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.model.hf_config import config_kwargs, normalize_rope_scaling


@dataclass
class Qwen3OmniTextConfig:
    """The hyper-parameters of the thinker's text decoder; names follow ``config.json``."""

    vocab_size: int = 3584
    hidden_size: int = 2048
    intermediate_size: int = 18944  # the dense MLP of ``mlp_only_layers``
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict[str, Any] | None = None  # None: plain (multimodal) RoPE
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])  # frequencies per t, h, w
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # the talker's gated shared expert; 0 (the thinker): none
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"unsupported hidden_act {self.hidden_act!r}")
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must be 3 sections of head_dim / 2 = "
                             f"{self.head_dim // 2} frequencies")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None:
            raise NotImplementedError(f"rope_type {self.rope_scaling['rope_type']!r} is not supported")
        self.mlp_only_layers = list(self.mlp_only_layers or [])

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a MoE MLP (else a dense SwiGLU)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3OmniTextConfig:
        """Build from a ``config.json`` dict: a whole Omni config (``thinker_config.text_config``),
        a thinker config (``text_config``) or the text config itself; unknown keys are ignored.
        The MRoPE sections come from ``rope_parameters`` (or ``rope_scaling``)."""
        d = d.get("thinker_config", d)
        d = d.get("text_config", d)
        kwargs = config_kwargs(cls, d, nullable={"pad_token_id", "bos_token_id", "eos_token_id", "head_dim"})
        rope = dict(kwargs.get("rope_scaling") or {})
        if "mrope_section" in rope:
            kwargs["mrope_section"] = list(rope.pop("mrope_section"))
        for key in ("interleaved", "mrope_interleaved"):  # Omni's MRoPE is always interleaved
            rope.pop(key, None)
        kwargs["rope_scaling"] = rope or None
        return cls(**kwargs)
