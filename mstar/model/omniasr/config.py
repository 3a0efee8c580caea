"""Omnilingual ASR CTC: the architecture's dimensions, for the four released sizes.

The encoder is wav2vec 2.0 (fairseq2's ``large_lv60k`` layout and its wider siblings): seven
convolutions over the waveform with a LayerNorm after each (320 samples a frame, 20 ms at
16 kHz), a LayerNorm and a projection to the model width, a grouped convolution as the
position encoding, pre-norm Transformer layers and a final LayerNorm; the CTC head is one
linear layer over the vocabulary (blank is id 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

SAMPLE_RATE = 16000
FEATURE_LAYERS = ((512, 10, 5),) + ((512, 3, 2),) * 4 + ((512, 2, 2),) * 2  # (channels, kernel, stride)


@dataclass(frozen=True)
class OmniAsrConfig:
    model_dim: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    ffn_dim: int = 4096
    vocab_size: int = 9812
    feature_layers: tuple[tuple[int, int, int], ...] = field(default=FEATURE_LAYERS)
    pos_conv_kernel: int = 128
    pos_conv_groups: int = 16
    layer_norm_eps: float = 1e-5
    blank_id: int = 0
    pad_id: int = 1

    @property
    def feature_dim(self) -> int:
        return self.feature_layers[-1][0]

    def frames(self, samples: int) -> int:
        """Encoder frames of a clip of ``samples`` samples (0 when too short for one)."""
        n = samples
        for _, kernel, stride in self.feature_layers:
            if n < kernel:
                return 0
            n = (n - kernel) // stride + 1
        return n

    @property
    def min_samples(self) -> int:
        """The shortest clip that yields one frame (400 samples: 25 ms)."""
        n = 1
        for _, kernel, stride in reversed(self.feature_layers):
            n = (n - 1) * stride + kernel
        return n

    def with_vocab(self, vocab_size: int) -> OmniAsrConfig:
        return replace(self, vocab_size=vocab_size)

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> OmniAsrConfig:
        """From transformers' ``OmniASRCTCConfig`` (``config.json`` with an ``audio_config``)."""
        audio = config.get("audio_config") or {}
        dims = audio.get("conv_dim", [c for c, _, _ in FEATURE_LAYERS])
        kernels = audio.get("conv_kernel", [k for _, k, _ in FEATURE_LAYERS])
        strides = audio.get("conv_stride", [s for _, _, s in FEATURE_LAYERS])
        return cls(model_dim=audio.get("hidden_size", 1024), num_layers=audio.get("num_hidden_layers", 24),
                   num_heads=audio.get("num_attention_heads", 16), ffn_dim=audio.get("intermediate_size", 4096),
                   vocab_size=config.get("vocab_size", 10288),
                   feature_layers=tuple(zip(dims, kernels, strides, strict=True)),
                   pos_conv_kernel=audio.get("num_conv_pos_embeddings", 128),
                   pos_conv_groups=audio.get("num_conv_pos_embedding_groups", 16),
                   layer_norm_eps=audio.get("layer_norm_eps", 1e-5), blank_id=config.get("blank_token_id", 0),
                   pad_id=config.get("pad_token_id", 1))


# The released encoders (fairseq2's wav2vec2 archs ``large_lv60k``, ``1b``, ``3b``, ``7b``);
# the vocabulary is the v1 tokenizer's (9,812 pieces), read from the tokenizer when one is given.
SIZES: dict[str, OmniAsrConfig] = {
    "300m": OmniAsrConfig(model_dim=1024, num_layers=24, num_heads=16, ffn_dim=4096),
    "1b": OmniAsrConfig(model_dim=1280, num_layers=48, num_heads=16, ffn_dim=5120),
    "3b": OmniAsrConfig(model_dim=2048, num_layers=60, num_heads=16, ffn_dim=8192),
    "7b": OmniAsrConfig(model_dim=2048, num_layers=128, num_heads=16, ffn_dim=8192),
}

# The v1 checkpoints on the Hub (Apache-2.0).
HUB_REPOS = {"300m": "facebook/omniASR-CTC-300M", "1b": "facebook/omniASR-CTC-1B",
             "3b": "facebook/omniASR-CTC-3B", "7b": "facebook/omniASR-CTC-7B"}
