"""Wan's prompt side, split the way the runtime needs it: the frontend cleans and tokenises the
prompt (padded to 512 tokens), the text-encoder node runs UMT5 and writes ``[512, d_model]``:
the real tokens' hidden states, then zeros (``WanPipeline._get_t5_prompt_embeds``). Every
prompt's features have the same shape, so requests batch at the DiT whatever their lengths.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.wan22.umt5 import UMT5Config, UMT5Encoder

MAX_LENGTH = 512  # the pipeline's max_sequence_length


def clean_prompt(text: str) -> str:
    """The pipeline's cleaning: ftfy's fixes (where ftfy is installed, as in diffusers), HTML
    entities unescaped twice, runs of whitespace collapsed."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


@dataclass
class WanText:
    tokenizer: Any
    config: UMT5Config
    max_length: int = MAX_LENGTH

    @classmethod
    def from_directory(cls, root: Path) -> WanText:
        from transformers import AutoTokenizer

        config = UMT5Config.from_dict(json.loads((root / "text_encoder" / "config.json").read_text()))
        return cls(AutoTokenizer.from_pretrained(root / "tokenizer"), config)

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [512], attention_mask [512])`` as the pipeline tokenises one prompt."""
        out = self.tokenizer([clean_prompt(prompt)], padding="max_length", max_length=self.max_length,
                             truncation=True, add_special_tokens=True, return_attention_mask=True,
                             return_tensors="pt")
        return out.input_ids[0], out.attention_mask[0]

    def build_encoder(self) -> UMT5Encoder:
        return UMT5Encoder(self.config)

    def graphed(self, encoder: UMT5Encoder):
        raise ValueError("cuda_graphs is not implemented for the UMT5 encoder")

    def encode(self, encoder: UMT5Encoder, ids: Sequence[torch.Tensor],
               masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Tokenised prompts -> ``[512, d_model]`` each: the real tokens' states, then zeros.
        Padding is masked out of the attention, so the stack runs only over the longest prompt
        of the batch (a shorter run gives the real tokens the same states)."""
        ids, masks = torch.stack(list(ids)), torch.stack(list(masks))
        lengths = masks.gt(0).sum(dim=1)
        span = int(lengths.max())
        device = encoder.shared.weight.device
        with torch.inference_mode():
            states = encoder(ids[:, :span].to(device), masks[:, :span].to(device))
        out = states.new_zeros(len(ids), self.max_length, states.shape[-1])
        for row, n in enumerate(lengths.tolist()):
            out[row, :n] = states[row, :n]
        return list(out)
