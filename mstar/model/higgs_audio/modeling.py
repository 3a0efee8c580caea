"""Higgs Audio v3 STT: a Whisper-large-v3 encoder (the audio tower), a strided MLP projector
and a Qwen3 LLM on paged KV.

The audio is encoded in slices of ``chunk_size_seconds`` (4 s), each on its own: Whisper's
two GELU convolutions (the second stride 2), its learned positions (the first rows of the
table), its pre-norm encoder layers (our Whisper encoder's, unchanged), then an average pool
of stride 2 over time and the final LayerNorm (25 frames per second; the pool comes before
the norm, as in Qwen2-Audio's tower). The projector (``audio_encoder_proj``) takes a depthwise
convolution of stride 2 over time (kernel 3), then ``linear1``, ReLU, ``linear2`` into the
LLM's width: 12.5 embeddings per second. A clip's slices' embeddings, concatenated, replace
the ``<|AUDIO|>`` tokens of the prompt; the LLM is ``Qwen3ForCausalLM`` with its own output
head (not tied to the embedding).

Slices of one length are batched together with no padding, so a slice encodes exactly as it
does alone (``encode_slices`` groups them by length). Parameter names: ``audio_tower.*`` and
``audio_encoder_proj.*`` are the release's; ``llm.*`` are ``Qwen3ForCausalLM``'s
(``checkpoint.py`` maps the release's top-level ``embed_tokens``, ``layers``, ``norm`` and
``audio_decoder_proj.text_lm_head`` onto them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.higgs_audio.config import AudioTowerConfig, HiggsAudioConfig
from mstar.model.qwen3.causal import Qwen3ForCausalLM
from mstar.model.whisper.config import WhisperConfig
from mstar.model.whisper.modeling import WhisperEncoderLayer


def whisper_layer_config(tower: AudioTowerConfig) -> WhisperConfig:
    """Our Whisper config holding the tower's sizes (its decoder fields unused)."""
    return WhisperConfig(vocab_size=1, num_mel_bins=tower.num_mel_bins, d_model=tower.d_model,
                         encoder_layers=tower.encoder_layers, encoder_attention_heads=tower.encoder_attention_heads,
                         decoder_layers=0, decoder_attention_heads=tower.encoder_attention_heads,
                         encoder_ffn_dim=tower.encoder_ffn_dim, decoder_ffn_dim=tower.encoder_ffn_dim,
                         max_source_positions=tower.max_source_positions,
                         activation_function=tower.activation_function)


class HiggsAudioTower(nn.Module):
    def __init__(self, config: AudioTowerConfig) -> None:
        super().__init__()
        d = config.d_model
        self.config = config
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        layer_config = whisper_layer_config(config)
        self.layers = nn.ModuleList(WhisperEncoderLayer(layer_config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Log-mels ``[B, n_mels, T]`` (one length, ``T <= 2 * max_source_positions``) ->
        ``[B, ceil(T / 2) // 2, d_model]``."""
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, S, d]
        if x.shape[1] > self.embed_positions.num_embeddings:
            raise ValueError(f"{mel.shape[-1]} mel frames: the tower takes at most "
                             f"{2 * self.embed_positions.num_embeddings}")
        x = x + self.embed_positions.weight[:x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = F.avg_pool1d(x.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)
        return self.layer_norm(x)


class HiggsAudioProjector(nn.Module):
    """``audio_encoder_proj``: depthwise temporal convolution (stride 2), then a ReLU MLP."""

    def __init__(self, audio_dim: int, hidden: int, out_dim: int, stride: int = 2) -> None:
        super().__init__()
        self.temporal = nn.Conv1d(audio_dim, audio_dim, kernel_size=3, stride=stride, padding=1, groups=audio_dim)
        self.linear1 = nn.Linear(audio_dim, hidden)
        self.linear2 = nn.Linear(hidden, out_dim)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """``[B, S, audio_dim]`` -> ``[B, ceil(S / 2), out_dim]``."""
        x = self.temporal(frames.transpose(1, 2)).transpose(1, 2)
        return self.linear2(F.relu(self.linear1(x)))


class HiggsAudioModel(nn.Module):
    def __init__(self, config: HiggsAudioConfig) -> None:
        super().__init__()
        self.config = config
        self.audio_tower = HiggsAudioTower(config.tower)
        self.audio_encoder_proj = HiggsAudioProjector(config.tower.d_model, config.projector_hidden_size,
                                                      config.llm.hidden_size, config.projector_temporal_downsample)
        self.llm = Qwen3ForCausalLM(config.llm)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """LLM input embeddings ``[B, P, llm_hidden]`` of slices' log-mels ``[B, n_mels, T]``."""
        return self.audio_encoder_proj(self.audio_tower(mel))

    def encode_slices(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each slice's embeddings ``[P_i, llm_hidden]`` of log-mels ``[n_mels, T_i]``: slices of
        one length in one forward, with no padding."""
        out: list[torch.Tensor | None] = [None] * len(mels)
        by_length: dict[int, list[int]] = {}
        for i, mel in enumerate(mels):
            by_length.setdefault(mel.shape[-1], []).append(i)
        for rows in by_length.values():
            embeds = self.encode(torch.stack([mels[i] for i in rows]))
            for i, e in zip(rows, embeds):
                out[i] = e
        return out  # type: ignore[return-value]

    def forward(self, input_ids, meta, kv_caches, inputs_embeds=None) -> torch.Tensor:
        return self.llm(input_ids, meta, kv_caches, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm.compute_logits(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llm.embed_input_ids(input_ids)

    def use_fused_kernels(self, enabled: bool = True) -> None:
        self.llm.use_fused_kernels(enabled)

    def cache_shape(self) -> tuple[int, int, int]:
        return self.llm.cache_shape()


__all__ = ["HiggsAudioModel", "HiggsAudioProjector", "HiggsAudioTower"]
