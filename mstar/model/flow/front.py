"""The flow module's parts around its encoder (CosyVoice2's ``CausalMaskedDiffWithXvec``,
Chatterbox S3Gen's flow): speech-token embedding, speaker projection, encoder projection and
the assembly of the estimator's conditioning stack.

A decode reads the prompt's speech tokens followed by the new ones; the encoder (an upsampling
conformer, not here) turns them into ``token_mel_ratio`` frames per token. The conditioning
stack then holds, per frame, the projected encoder output ``mu``, the speaker vector (the
x-vector L2-normalised, then projected to the mel width) and the prompt's own mel over the
prompt's frames (zero after). The sampler produces mel for every frame; the caller keeps the
frames after the prompt (``new_frames``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.flow.estimator import FlowEstimator

__all__ = ["FlowFront", "FlowFrontConfig", "flow_front_name_map"]


@dataclass(frozen=True)
class FlowFrontConfig:
    """The defaults are CosyVoice2-0.5B's (S3Gen's too)."""

    vocab_size: int = 6561  # speech tokens
    token_dim: int = 512  # the encoder's input width
    encoder_dim: int = 512  # the encoder's output width
    speaker_dim: int = 192  # the x-vector (CAM++) width
    mel_channels: int = 80


class FlowFront(nn.Module):
    def __init__(self, config: FlowFrontConfig = FlowFrontConfig()):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.token_dim)
        self.speaker_proj = nn.Linear(config.speaker_dim, config.mel_channels)
        self.encoder_proj = nn.Linear(config.encoder_dim, config.mel_channels)

    def embed_tokens(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Speech tokens ``[B, L]`` (padding may be negative) as the encoder's input
        ``[B, L, token_dim]``, zero past each row's length."""
        valid = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
        return self.token_embedding(tokens.clamp(min=0)) * valid[..., None]

    def speaker(self, xvector: torch.Tensor) -> torch.Tensor:
        """The x-vector ``[B, speaker_dim]`` as the estimator's speaker input ``[B, mel]``."""
        return self.speaker_proj(F.normalize(xvector, dim=1))

    def conditioning(self, encoded: torch.Tensor, xvector: torch.Tensor, prompt_mel: torch.Tensor) -> torch.Tensor:
        """The estimator's conditioning stack ``[B, 3 * mel, T]`` from the encoder's output
        ``[B, T, encoder_dim]``, the x-vector ``[B, speaker_dim]`` and the prompt mel
        ``[B, T_prompt, mel]`` (its frames are the first ``T_prompt`` of ``T``)."""
        mu = self.encoder_proj(encoded).transpose(1, 2)
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_mel.shape[1]] = prompt_mel.transpose(1, 2)
        return FlowEstimator.conditioning(mu, self.speaker(xvector).to(mu.dtype), cond)

    @staticmethod
    def new_frames(mel: torch.Tensor, prompt_mel: torch.Tensor) -> torch.Tensor:
        """The decoded mel ``[B, mel, T]`` without the prompt's frames."""
        return mel[:, :, prompt_mel.shape[1]:]


_FRONT_NAMES = {
    "input_embedding.weight": "token_embedding.weight",
    "spk_embed_affine_layer.weight": "speaker_proj.weight",
    "spk_embed_affine_layer.bias": "speaker_proj.bias",
    "encoder_proj.weight": "encoder_proj.weight",
    "encoder_proj.bias": "encoder_proj.bias",
}


def flow_front_name_map(name: str, prefix: str = "") -> str | None:
    """A released flow checkpoint's name as ``FlowFront`` calls it, or None for the encoder's
    and the decoder's names. ``prefix``: where the flow module sits in the file (``""`` in
    CosyVoice2's ``flow.pt``, ``"flow."`` in Chatterbox's ``s3gen`` weights)."""
    return _FRONT_NAMES.get(name[len(prefix):]) if name.startswith(prefix) else None
