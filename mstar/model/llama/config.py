"""Configuration of Llama-architecture decoders (SmolLM2, Orpheus, Llama 2/3, ...)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


def _normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Canonical ``rope_scaling``: ``None`` for plain RoPE, else a dict keyed by ``rope_type``
    (the legacy ``type`` key is renamed, ``rope_theta`` is dropped)."""
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    out["rope_type"] = rope_type
    return out


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
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)
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
        names = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        nullable = {"bos_token_id", "eos_token_id"}  # null is meaningful for these only
        kwargs = {k: d[k] for k in names if k in d and (d[k] is not None or k in nullable)}
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, dict) and rope_params:
            theta = rope_params.get("rope_theta", d.get("rope_theta"))
            kwargs["rope_scaling"] = rope_params
        else:
            theta = d.get("rope_theta")
            kwargs["rope_scaling"] = d.get("rope_scaling")
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict, RoPE as transformers 5 ``rope_parameters``."""
        out: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        for f in fields(self):
            if f.name not in ("rope_theta", "rope_scaling"):
                out[f.name] = getattr(self, f.name)
        rope: dict[str, Any] = {"rope_type": "default"}
        rope.update(self.rope_scaling or {})
        rope["rope_theta"] = self.rope_theta
        out["rope_parameters"] = rope
        return out
