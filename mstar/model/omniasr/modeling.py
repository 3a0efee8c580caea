"""Omnilingual ASR CTC: the wav2vec 2.0 encoder and the CTC head as plain modules.

Parameter names are the released checkpoint's (fairseq2's ``Wav2Vec2AsrModel``), so its
tensors load by name; ``checkpoint.py`` maps transformers' ``OmniASRForCTC`` names onto them.
The position convolution keeps the release's weight norm (``weight_g``, ``weight_v``) and
folds it on every call, as the reference does at inference.

A batch is padded waveforms and their lengths. Every valid frame of a clip depends only on
its own samples (the convolutions read no further than the clip's end for its valid frames),
padded frames are zeroed before the position convolution and masked as attention keys, so a
clip batched with others gets its solo frames (to the kernels' rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.omniasr.config import OmniAsrConfig


class FeatureLayer(nn.Module):
    """A convolution over time, a LayerNorm over its channels, GELU."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int, stride: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_dim, out_dim, kernel, stride=stride)
        self.layer_norm = nn.LayerNorm(out_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C', T']
        x = self.conv(x)
        x = self.layer_norm(x.transpose(1, 2)).transpose(1, 2)
        return F.gelu(x)


class FeatureExtractor(nn.Module):
    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        dims = [1] + [c for c, _, _ in config.feature_layers]
        self.layers = nn.ModuleList(
            FeatureLayer(dims[i], c, k, s, config.layer_norm_eps) for i, (c, k, s) in enumerate(config.feature_layers))

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, T, C]
        x = waveform[:, None, :]
        for layer in self.layers:
            x = layer(x)
        return x.transpose(1, 2)


class PositionConv(nn.Module):
    """A grouped convolution, weight-normed over its kernel axis; its output (one frame
    trimmed from the end: the kernel is even) goes through GELU and is added to the input."""

    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        dim, kernel = config.model_dim, config.pos_conv_kernel
        self.groups, self.padding = config.pos_conv_groups, kernel // 2
        self.weight_g = nn.Parameter(torch.ones(1, 1, kernel))
        self.weight_v = nn.Parameter(torch.empty(dim, dim // config.pos_conv_groups, kernel))
        self.bias = nn.Parameter(torch.zeros(dim))

    def weight(self) -> torch.Tensor:
        norm = self.weight_v.norm(dim=(0, 1), keepdim=True)
        return self.weight_v * (self.weight_g / norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        y = F.conv1d(x.transpose(1, 2), self.weight(), self.bias, padding=self.padding, groups=self.groups)
        if self.padding * 2 == self.weight_v.shape[-1]:
            y = y[:, :, :-1]
        return x + F.gelu(y).transpose(1, 2)


class Frontend(nn.Module):
    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        self.feature_extractor = FeatureExtractor(config)
        self.post_extract_layer_norm = nn.LayerNorm(config.feature_dim, eps=config.layer_norm_eps)
        self.model_dim_proj = nn.Linear(config.feature_dim, config.model_dim)
        self.pos_encoder = nn.Module()
        self.pos_encoder.conv = PositionConv(config)


class SelfAttention(nn.Module):
    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        dim = config.model_dim
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.output_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape

        def heads(p: torch.Tensor) -> torch.Tensor:
            return p.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=mask)
        return self.output_proj(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        self.inner_proj = nn.Linear(config.model_dim, config.ffn_dim)
        self.output_proj = nn.Linear(config.ffn_dim, config.model_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_proj(F.gelu(self.inner_proj(x)))


class EncoderLayer(nn.Module):
    """Pre-norm: attention, then the feed-forward, each added to its input."""

    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.model_dim, eps=config.layer_norm_eps)
        self.self_attn = SelfAttention(config)
        self.ffn_layer_norm = nn.LayerNorm(config.model_dim, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.ffn(self.ffn_layer_norm(x))


class Encoder(nn.Module):
    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.layer_norm = nn.LayerNorm(config.model_dim, eps=config.layer_norm_eps)


class OmniAsrCtc(nn.Module):
    """Waveforms in, CTC logits out (``forward``); ``greedy`` takes the per-frame argmax."""

    def __init__(self, config: OmniAsrConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder_frontend = Frontend(config)
        self.encoder = Encoder(config)
        self.final_proj = nn.Linear(config.model_dim, config.vocab_size)

    def frame_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        for _, kernel, stride in self.config.feature_layers:
            lengths = torch.div(lengths - kernel, stride, rounding_mode="floor") + 1
        return lengths.clamp(min=0)

    def forward(self, waveform: torch.Tensor, lengths: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``waveform`` ``[B, N]`` (normalised, zero past each clip's ``lengths``; None: all
        full) -> logits ``[B, T, vocab]`` and each clip's frame count ``[B]``."""
        front = self.encoder_frontend
        x = front.feature_extractor(waveform)
        x = front.model_dim_proj(front.post_extract_layer_norm(x))
        frames = torch.full((x.shape[0],), x.shape[1], dtype=torch.int64, device=x.device)
        key_mask = None
        if lengths is not None:
            frames = self.frame_lengths(lengths.to(x.device)).clamp(max=x.shape[1])
            valid = torch.arange(x.shape[1], device=x.device)[None, :] < frames[:, None]
            if not bool(valid.all()):
                key_mask = valid
                x = x.masked_fill(~valid[..., None], 0.0)
        x = front.pos_encoder.conv(x)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.final_proj(self.encoder.layer_norm(x)), frames

    def greedy(self, logits: torch.Tensor, frames: torch.Tensor) -> list[list[int]]:
        """Each clip's per-frame argmax over its valid frames (CTC collapse is the tokenizer's)."""
        best = logits.argmax(dim=-1).tolist()
        return [row[:n] for row, n in zip(best, frames.tolist())]


def normalize_utterance(samples: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Zero mean, unit (biased) variance over the whole clip, ``eps`` inside the root: the
    reference's layer norm over the waveform, in float32."""
    x = samples.to(torch.float32)
    return F.layer_norm(x, x.shape[-1:], eps=eps)
