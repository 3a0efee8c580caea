"""Configuration of OmniVoice (k2-fsa/OmniVoice): the canvas backbone and its audio codec.

Two ``config.json`` files make a release: the top one (``model_type: omnivoice``) holds the
canvas settings and the Qwen3 backbone under ``llm_config``; ``audio_tokenizer/config.json``
is transformers' ``HiggsAudioV2TokenizerConfig``, of which only the decoder half is read here
(the residual quantizer and the DAC decoder; the semantic side only lends its width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mstar.model.qwen3.config import Qwen3Config

# Keys of the released config.json whose value is fixed by the model.
AUDIO_VOCAB_SIZE = 1025  # 1024 codes + the mask id
AUDIO_MASK_ID = 1024


@dataclass
class CodecConfig:
    """The decoder half of the Higgs Audio v2 tokenizer (a 25 Hz RVQ codec at 24 kHz)."""

    sample_rate: int = 24000
    codebook_size: int = 1024
    codebook_dim: int = 64
    target_bandwidths: tuple[float, ...] = (0.5, 1, 1.5, 2, 4)
    acoustic_hidden_size: int = 256  # the DAC latent width (fc2's output)
    semantic_hidden_size: int = 768  # HuBERT's width; with the acoustic one, the RVQ width
    decoder_hidden_size: int = 1024
    upsampling_ratios: tuple[int, ...] = (8, 5, 4, 2, 3)
    downsampling_ratios: tuple[int, ...] = (8, 5, 4, 2, 3)
    # The encoder side (reference clips -> codes).
    encoder_hidden_size: int = 64
    semantic: dict[str, Any] = field(default_factory=dict)  # HuBERT's config.json dict
    semantic_sample_rate: int = 16000
    downsample_factor: int = 320
    kernel_size: int = 3
    channel_ratios: tuple[float, ...] = (1, 1)
    strides: tuple[int, ...] = (1, 1)
    block_dilations: tuple[int, ...] = (1, 1)
    unit_kernel_size: int = 3

    @property
    def hidden_size(self) -> int:
        """Width of the quantised embedding (acoustic + semantic)."""
        return self.acoustic_hidden_size + self.semantic_hidden_size

    @property
    def hop_length(self) -> int:
        return math.prod(self.downsampling_ratios)

    @property
    def frame_rate(self) -> int:
        return math.ceil(self.sample_rate / self.hop_length)

    @property
    def semantic_stride(self) -> int:
        """Every how many HuBERT frames one codec frame takes."""
        return int(self.hop_length / (self.sample_rate / self.semantic_sample_rate) / self.downsample_factor)

    @property
    def num_quantizers(self) -> int:
        """Quantizers in the checkpoint: as many as the highest bandwidth needs."""
        bits = math.ceil(math.log2(self.codebook_size))
        return int(1000 * self.target_bandwidths[-1] // (self.frame_rate * bits))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> CodecConfig:
        """From ``audio_tokenizer/config.json`` (transformers' defaults for missing keys)."""
        acoustic = d.get("acoustic_model_config") or {}
        semantic = d.get("semantic_model_config") or {}
        base = cls()
        semantic = {"mask_time_prob": 0.0, **semantic}
        return cls(
            sample_rate=d.get("sample_rate", base.sample_rate),
            codebook_size=d.get("codebook_size", base.codebook_size),
            codebook_dim=d.get("codebook_dim", base.codebook_dim),
            target_bandwidths=tuple(d.get("target_bandwidths", base.target_bandwidths)),
            acoustic_hidden_size=acoustic.get("hidden_size", 256),
            semantic_hidden_size=semantic.get("hidden_size", 768),
            decoder_hidden_size=acoustic.get("decoder_hidden_size", 1024),
            upsampling_ratios=tuple(acoustic.get("upsampling_ratios", (8, 5, 4, 2))),
            downsampling_ratios=tuple(acoustic.get("downsampling_ratios", (8, 5, 4, 2))),
            encoder_hidden_size=acoustic.get("encoder_hidden_size", 64),
            semantic=semantic,
            semantic_sample_rate=d.get("semantic_sample_rate", 16000),
            downsample_factor=d.get("downsample_factor", 320),
            kernel_size=d.get("kernel_size", 3),
            channel_ratios=tuple(d.get("channel_ratios", (1, 1))),
            strides=tuple(d.get("strides", (1, 1))),
            block_dilations=tuple(d.get("block_dilations", (1, 1))),
            unit_kernel_size=d.get("unit_kernel_size", 3),
        )


@dataclass
class OmniVoiceConfig:
    """The canvas model: ``num_audio_codebook`` rows of ``audio_vocab_size`` ids each over a
    Qwen3 backbone run with full (bidirectional) attention."""

    llm: Qwen3Config = field(default_factory=Qwen3Config)
    codec: CodecConfig = field(default_factory=CodecConfig)
    audio_vocab_size: int = AUDIO_VOCAB_SIZE
    audio_mask_id: int = AUDIO_MASK_ID
    num_audio_codebook: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.audio_mask_id < self.audio_vocab_size:
            raise ValueError(f"audio_mask_id {self.audio_mask_id} outside audio_vocab_size "
                             f"{self.audio_vocab_size}")
        if self.num_audio_codebook > self.codec.num_quantizers:
            raise ValueError(f"num_audio_codebook {self.num_audio_codebook} exceeds the codec's "
                             f"{self.codec.num_quantizers} quantizers")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], codec: dict[str, Any] | None = None) -> OmniVoiceConfig:
        """From the release's ``config.json`` (and ``audio_tokenizer/config.json``)."""
        return cls(
            llm=Qwen3Config.from_hf_dict(d["llm_config"]),
            codec=CodecConfig.from_hf_dict(codec or {}),
            audio_vocab_size=d.get("audio_vocab_size", AUDIO_VOCAB_SIZE),
            audio_mask_id=d.get("audio_mask_id", AUDIO_MASK_ID),
            num_audio_codebook=d.get("num_audio_codebook", 8),
        )


TINY_HUBERT = {"model_type": "hubert", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
               "intermediate_size": 16, "conv_dim": [8] * 7, "conv_stride": [5, 2, 2, 2, 2, 2, 2],
               "conv_kernel": [10, 3, 3, 3, 3, 2, 2], "num_conv_pos_embeddings": 4,
               "num_conv_pos_embedding_groups": 2, "mask_time_prob": 0.0}


def tiny_config() -> OmniVoiceConfig:
    """A small config for tests and dummy weights (the text vocabulary must hold the mask id,
    which pads canvas rows and is embedded as text there)."""
    llm = Qwen3Config(vocab_size=1100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      rope_theta=1_000_000.0, max_position_embeddings=2048)
    # 25 codec frames a second as released (hop 96 at 2.4 kHz); HuBERT at 16 kHz, 50 frames a second.
    codec = CodecConfig(sample_rate=2400, codebook_size=1024, codebook_dim=8, target_bandwidths=(0.5, 1),
                        acoustic_hidden_size=16, semantic_hidden_size=8, decoder_hidden_size=32,
                        upsampling_ratios=(4, 4, 6), downsampling_ratios=(4, 4, 6), encoder_hidden_size=4,
                        semantic=TINY_HUBERT)
    return OmniVoiceConfig(llm=llm, codec=codec, num_audio_codebook=4)
