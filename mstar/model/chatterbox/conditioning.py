"""T3's conditioning rows: speaker, prompt speech and emotion, ahead of the text.

A request is conditioned on a reference voice through three parts, concatenated in this order
into the rows that open every T3 prompt:

* the voice encoder's speaker embedding, projected by ``spkr_enc`` (one row);
* the reference clip's S3 speech tokens (``speech_cond_prompt_len`` of them at most), embedded
  with T3's own speech table and, on the Llama variants, resampled by the perceiver to a fixed
  ``queries`` rows (Turbo keeps them as they are);
* ``exaggeration`` (the reference calls it ``emotion_adv``), a scalar projected by
  ``emotion_adv_fc`` (one row; Llama variants only).

Parameter names are the released checkpoint's (``cond_enc.*``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.chatterbox.config import PerceiverConfig, T3Config


@dataclass
class T3Conditioning:
    """One voice: ``speaker_emb [1, speaker_embed_size]``, ``prompt_tokens [1, P]`` (S3 ids;
    ``P`` may be 0) and the exaggeration ``emotion`` (ignored by Turbo)."""

    speaker_emb: torch.Tensor
    prompt_tokens: torch.Tensor
    emotion: float = 0.5


class CrossAttentionBlock(nn.Module):
    """Pre-norm attention of ``x`` over ``context`` (one LayerNorm shared by both), with a
    residual on ``x``. Used twice by the perceiver: queries over the prompt, then over
    themselves."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.to_q(self.norm(x)))
        kv_in = self.norm(context)
        k, v = self._heads(self.to_k(kv_in)), self._heads(self.to_v(kv_in))
        out = F.scaled_dot_product_attention(q, k, v)  # no mask: every query sees every row
        batch, _, length, head_dim = out.shape
        return x + self.proj_out(out.transpose(1, 2).reshape(batch, length, self.heads * head_dim))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        return x.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)


class Perceiver(nn.Module):
    """Resamples a variable number of prompt rows to ``queries`` learned query rows: the
    queries attend to the prompt, then to themselves, through the same block (one set of
    weights, used twice, as the reference does)."""

    def __init__(self, dim: int, config: PerceiverConfig) -> None:
        super().__init__()
        self.pre_attention_query = nn.Parameter(torch.zeros(1, config.queries, dim))
        self.attn = CrossAttentionBlock(dim, config.heads)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        queries = self.pre_attention_query.expand(prompt.shape[0], -1, -1)
        resampled = self.attn(queries, prompt)
        return self.attn(resampled, resampled)


class T3CondEnc(nn.Module):
    """Speaker, prompt and emotion rows ``[B, rows, hidden]`` (``cond_enc`` in the checkpoint).
    The prompt arrives already embedded (T3 owns the speech embedding table)."""

    def __init__(self, config: T3Config) -> None:
        super().__init__()
        dim = config.hidden_size
        self.spkr_enc = nn.Linear(config.speaker_embed_size, dim)
        self.emotion_adv_fc = nn.Linear(1, dim, bias=False) if config.emotion_adv else None
        self.perceiver = Perceiver(dim, config.perceiver) if config.perceiver is not None else None

    def forward(self, speaker_emb: torch.Tensor, prompt_emb: torch.Tensor,
                emotion: torch.Tensor | None) -> torch.Tensor:
        """``speaker_emb [B, S]``, ``prompt_emb [B, P, hidden]`` and ``emotion [B]`` (None
        when the variant has no emotion input)."""
        rows = [self.spkr_enc(speaker_emb.reshape(-1, self.spkr_enc.in_features))[:, None]]
        if prompt_emb.shape[1] > 0:
            rows.append(self.perceiver(prompt_emb) if self.perceiver is not None else prompt_emb)
        if self.emotion_adv_fc is not None:
            if emotion is None:
                raise ValueError("this T3 variant needs an exaggeration (emotion_adv) value")
            rows.append(self.emotion_adv_fc(emotion.reshape(-1, 1, 1)))
        return torch.cat(rows, dim=1)
