"""Configuration of Whisper encoder-decoder speech models (tiny ... large-v3, distil-whisper)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Feed-forward activations Whisper checkpoints may name (all real ones use exact "gelu").
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass
class WhisperConfig:
    """The hyper-parameters of a Whisper model; names follow Hugging Face ``config.json``.

    ``scale_embedding`` is kept for round-tripping only: Hugging Face computes an embedding
    scale from it but never applies it (nor does OpenAI's original), so neither do we.
    """

    vocab_size: int
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    decoder_layers: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_source_positions: int = 1500  # encoder frames (after the stride-2 conv)
    max_target_positions: int = 448  # decoder positions
    activation_function: str = "gelu"
    scale_embedding: bool = False
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 50256
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    decoder_start_token_id: int = 50257
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        for side in ("encoder", "decoder"):
            heads = getattr(self, f"{side}_attention_heads")
            if self.d_model % heads:
                raise ValueError(f"d_model {self.d_model} not a multiple of {side} heads {heads}")
        if self.activation_function not in SUPPORTED_ACTIVATIONS:
            raise NotImplementedError(f"unsupported activation {self.activation_function!r}")
        if not self.tie_word_embeddings:
            raise NotImplementedError("Whisper output projection must be tied to embed_tokens")
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, [int(t) for t in value])

    @property
    def num_mel_frames(self) -> int:
        """Mel frames the encoder expects (two per encoder position: conv2 has stride 2)."""
        return 2 * self.max_source_positions

    @property
    def decoder_head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> WhisperConfig:
        """Build from a Hugging Face ``config.json`` dict (unknown keys are ignored)."""
        nullable = {
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
            "suppress_tokens",
            "begin_suppress_tokens",
        }
        names = {f.name for f in fields(cls)}
        kwargs = {k: d[k] for k in names if k in d and (d[k] is not None or k in nullable)}
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict for ``WhisperForConditionalGeneration``."""
        out: dict[str, Any] = {
            "architectures": ["WhisperForConditionalGeneration"],
            "model_type": "whisper",
            "is_encoder_decoder": True,
        }
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, list) else value
        return out
