"""Configuration of Higgs Audio v3 STT (``bosonai/higgs-audio-v3-stt``), read from its
``config.json``: the Whisper-style audio tower from ``audio_encoder_config``, the Qwen3 LLM
from ``text_config``, the projector's temporal stride (``projector_temporal_downsample``), the
audio special tokens (``audio_in_token_idx``, ``audio_bos_token_id``, ``audio_eos_token_id``)
and the length of the slices the audio is encoded in (``chunk_size_seconds``, 4 s).

The release's own modeling code (``trust_remote_code``) was not reachable here: these keys
and their meaning come from public code that loads the checkpoint (see docs/higgs_audio.md).
A setting this port does not build is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.model.qwen3.config import Qwen3Config
from mstar.model.whisper.features import HOP_LENGTH, SAMPLE_RATE

# The release's ids in the Qwen3 tokenizer (used when config.json leaves a key out).
AUDIO_IN, AUDIO_BOS, AUDIO_EOS = 151672, 151669, 151670


@dataclass(frozen=True)
class AudioTowerConfig:
    """The Whisper encoder's sizes (``audio_encoder_config``, Whisper's key names)."""

    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    num_mel_bins: int = 128
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"audio_encoder_config.d_model ({self.d_model}) is not a multiple of "
                             f"encoder_attention_heads ({self.encoder_attention_heads})")
        if self.activation_function != "gelu":
            raise NotImplementedError(f"audio_encoder_config.activation_function: "
                                      f"{self.activation_function!r} (only 'gelu')")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioTowerConfig:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})


@dataclass(frozen=True)
class HiggsAudioConfig:
    tower: AudioTowerConfig
    llm: Qwen3Config
    projector_hidden_size: int = 2048
    projector_temporal_downsample: int = 2
    audio_in_token_id: int = AUDIO_IN
    audio_bos_token_id: int = AUDIO_BOS
    audio_eos_token_id: int = AUDIO_EOS
    chunk_size_seconds: float = 4.0

    def __post_init__(self) -> None:
        if self.projector_temporal_downsample != 2:
            raise NotImplementedError(f"projector_temporal_downsample: {self.projector_temporal_downsample} "
                                      "(only 2 is supported)")
        if self.chunk_frames > 2 * self.tower.max_source_positions:
            raise ValueError(f"chunk_size_seconds ({self.chunk_size_seconds}) is longer than the audio tower's "
                             f"{2 * self.tower.max_source_positions} mel frames")

    @property
    def chunk_samples(self) -> int:
        """Samples of one encoded slice of audio (the last one of a clip may be shorter)."""
        return int(round(self.chunk_size_seconds * SAMPLE_RATE))

    @property
    def chunk_frames(self) -> int:
        return self.chunk_samples // HOP_LENGTH

    @staticmethod
    def positions(mel_frames: int) -> int:
        """Audio embeddings (LLM positions) of a slice of ``mel_frames`` log-mel frames: the
        tower's stride-2 convolution, its stride-2 average pool, the projector's stride-2
        convolution (25 then 12.5 per second)."""
        conv = (mel_frames - 1) // 2 + 1
        pooled = conv // 2
        return (pooled - 1) // 2 + 1 if pooled > 0 else 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> HiggsAudioConfig:
        if "text_config" not in d or "audio_encoder_config" not in d:
            raise ValueError("config.json: expected text_config and audio_encoder_config sections")
        if d.get("skip_audio_tower"):
            raise NotImplementedError("skip_audio_tower: true (a checkpoint without the audio tower)")
        if d.get("audio_adapter_type", "mlp") not in ("mlp", None):
            raise NotImplementedError(f"audio_adapter_type: {d.get('audio_adapter_type')!r} (only 'mlp')")
        text = dict(d["text_config"])
        # The release stores its text head apart (audio_decoder_proj.text_lm_head) whatever the flag says.
        text["tie_word_embeddings"] = False
        llm = Qwen3Config.from_hf_dict(text)
        return cls(tower=AudioTowerConfig.from_dict(d["audio_encoder_config"]), llm=llm,
                   projector_hidden_size=int(d.get("projector_hidden_size", llm.hidden_size)),
                   projector_temporal_downsample=int(d.get("projector_temporal_downsample", 2)),
                   audio_in_token_id=int(d.get("audio_in_token_idx", AUDIO_IN)),
                   audio_bos_token_id=int(d.get("audio_bos_token_id", AUDIO_BOS)),
                   audio_eos_token_id=int(d.get("audio_eos_token_id", AUDIO_EOS)),
                   chunk_size_seconds=float(d.get("chunk_size_seconds", 4.0)))
