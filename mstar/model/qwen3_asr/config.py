"""Configuration of Qwen3-ASR (Qwen/Qwen3-ASR-1.7B, Qwen/Qwen3-ASR-0.6B), read from either
``config.json`` layout: the released one (everything under ``thinker_config``) or
transformers' (``audio_config`` and ``text_config`` at the top).

The audio side is AuT: three stride-2 convolutions over 1 s chunks of log-mels
(``2 * n_window`` frames), a linear to ``d_model``, a Whisper-style pre-norm transformer whose
attention stays inside windows of ``n_window_infer`` mel frames (8 s), a final LayerNorm and a
two-layer projector to the LLM's width. The LLM is a dense Qwen3 decoder. The released text
config describes multimodal RoPE (``mrope_section``); an audio-only prompt gives all three
position axes the same index, where MRoPE is plain RoPE, so those keys are dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.model.qwen3.config import Qwen3Config

_MROPE_KEYS = ("mrope_section", "interleaved", "mrope_interleaved")


def post_cnn_length(frames: int) -> int:
    """Positions one chunk of ``frames`` mel frames leaves after three (k=3, s=2, p=1) convs."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


@dataclass(frozen=True)
class AuTConfig:
    """The AuT audio encoder and its projector (transformers' ``Qwen3ASREncoderConfig``)."""

    num_mel_bins: int = 128
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    d_model: int = 1024
    output_dim: int = 2048
    n_window: int = 50
    n_window_infer: int = 800
    downsample_hidden_size: int = 480
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"audio_config.d_model ({self.d_model}) is not a multiple of encoder_attention_heads "
                             f"({self.encoder_attention_heads})")
        if self.n_window_infer % self.chunk_frames:
            raise ValueError(f"audio_config.n_window_infer ({self.n_window_infer}) is not a multiple of "
                             f"2 * n_window ({self.chunk_frames})")
        if self.activation_function != "gelu":
            raise NotImplementedError(f"audio_config.activation_function {self.activation_function!r} (gelu only)")

    @property
    def chunk_frames(self) -> int:
        """Mel frames of one convolution chunk (1 s)."""
        return 2 * self.n_window

    @property
    def window_positions(self) -> int:
        """Encoder positions of one attention window (104 for 8 s windows of 1 s chunks)."""
        return post_cnn_length(self.chunk_frames) * (self.n_window_infer // self.chunk_frames)

    @property
    def freq_bins(self) -> int:
        """Mel bins left after the three stride-2 convolutions."""
        bins = self.num_mel_bins
        for _ in range(3):
            bins = (bins + 1) // 2
        return bins

    def positions(self, mel_frames: int) -> int:
        """Encoder outputs (LLM audio positions) of a clip of ``mel_frames`` frames."""
        full, rest = divmod(mel_frames, self.chunk_frames)
        return full * post_cnn_length(self.chunk_frames) + post_cnn_length(rest)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> AuTConfig:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Qwen3ASRConfig:
    audio: AuTConfig
    llm: Qwen3Config
    audio_token_id: int = 151676

    def __post_init__(self) -> None:
        if self.audio.output_dim != self.llm.hidden_size:
            raise ValueError(f"audio_config.output_dim ({self.audio.output_dim}) is not the text model's "
                             f"hidden_size ({self.llm.hidden_size})")
        if self.audio_token_id >= self.llm.vocab_size:
            raise ValueError(f"audio_token_id ({self.audio_token_id}) is outside the vocabulary "
                             f"({self.llm.vocab_size})")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3ASRConfig:
        """From a ``config.json`` dict in the released layout or transformers'."""
        top = d.get("thinker_config") or d
        text = dict(top.get("text_config") or {})
        scaling = text.get("rope_scaling") or text.get("rope_parameters")
        if isinstance(scaling, dict) and any(k in scaling for k in _MROPE_KEYS):
            kept = {k: v for k, v in scaling.items() if k not in _MROPE_KEYS}
            text["rope_scaling" if "rope_scaling" in text else "rope_parameters"] = kept
        if "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
        return cls(audio=AuTConfig.from_hf_dict(top.get("audio_config") or {}), llm=Qwen3Config.from_hf_dict(text),
                   audio_token_id=int(top.get("audio_token_id", top.get("audio_token_index", 151676))))


__all__ = ["AuTConfig", "Qwen3ASRConfig", "post_cnn_length"]
