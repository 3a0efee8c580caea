"""Configuration of Canary (FastConformer encoder + Transformer decoder), read from a Hugging
Face ``config.json`` (``model_type: canary``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mstar.model.fastconformer.config import FastConformerConfig

DECODER_ACTIVATIONS = ("relu", "gelu", "silu")


@dataclass
class CanaryDecoderConfig:
    """The decoder: pre-norm blocks of causal self-attention, cross-attention to the encoder
    frames and an MLP, over token embeddings plus fixed sinusoidal positions."""

    vocab_size: int = 16384
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "relu"
    max_position_embeddings: int = 1024
    attention_bias: bool = True
    pad_token_id: int | None = 2

    def __post_init__(self) -> None:
        if self.hidden_act not in DECODER_ACTIVATIONS:
            raise NotImplementedError(f"unsupported decoder activation {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size % 2:
            raise ValueError("the sinusoidal positions need an even hidden_size")


@dataclass
class CanaryConfig:
    encoder: FastConformerConfig
    decoder: CanaryDecoderConfig
    bos_token_id: int = 4
    eos_token_id: int = 3
    pad_token_id: int = 2
    decoder_start_token_id: int = 7
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.encoder.hidden_size != self.decoder.hidden_size:
            raise NotImplementedError(f"the decoder cross-attends to the encoder's {self.encoder.hidden_size} "
                                      f"features with a hidden size of {self.decoder.hidden_size}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> CanaryConfig:
        if d.get("model_type") != "canary":
            raise NotImplementedError(f"unsupported model_type {d.get('model_type')!r} (expected 'canary')")
        decoder_names = {f.name for f in fields(CanaryDecoderConfig)}
        decoder = {k: v for k, v in (d.get("decoder_config") or {}).items() if k in decoder_names and v is not None}
        top = {k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                                 "tie_word_embeddings") if d.get(k) is not None}
        return cls(encoder=FastConformerConfig.from_hf_dict(d.get("encoder_config") or {}),
                   decoder=CanaryDecoderConfig(**decoder), **top)
