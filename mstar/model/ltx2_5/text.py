"""The text node: prompt -> Gemma token ids -> every layer's hidden state -> the connectors'
video and audio prompt features (``LTX2Pipeline.encode_prompt`` + ``connectors``).

Prompts are stripped, left padded to a fixed ``max_length`` (1024 by default; the connectors
replace the padding by their registers, so the length must be a multiple of their register
count), the pad token falling back to EOS as the pipeline does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mstar.model.ltx2_5.connectors import LtxTextConnectors
from mstar.model.ltx2_5.gemma import GemmaTextModel

MAX_PROMPT_TOKENS = 1024


def tokenize(tokenizer: Any, prompts: Sequence[str], max_length: int = MAX_PROMPT_TOKENS
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[B, max_length]``, left padded, truncated to ``max_length``."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer([p.strip() for p in prompts], padding="max_length", max_length=max_length, truncation=True,
                    add_special_tokens=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


class LtxTextEncoder(nn.Module):
    """Gemma (``text_encoder``) and the connectors (``connectors``) as one component."""

    def __init__(self, text_encoder: GemmaTextModel, connectors: LtxTextConnectors) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.connectors = connectors

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the video and audio prompt features ``[B, L, width]`` and their mask."""
        states = torch.stack(self.text_encoder.hidden_states(ids, mask), dim=-1)  # [B, L, hidden, layers + 1]
        dtype = self.connectors.video_connector.learnable_registers.dtype
        return self.connectors(states.to(dtype), mask)
