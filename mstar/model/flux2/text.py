"""FLUX.2 [klein]'s text side, split the way the runtime needs it: the frontend tokenises
(chat template, padded to a fixed length), the text-encoder node runs only the Qwen3 layers
whose hidden states the DiT reads and concatenates them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mstar.model.qwen3 import KLEIN_MAX_LENGTH, KLEIN_TAP_LAYERS, Qwen3Config, Qwen3TextEncoder
from mstar.model.qwen3.klein import _tokenize_chat


@dataclass
class KleinText:
    tokenizer: Any
    config: Qwen3Config
    max_length: int = KLEIN_MAX_LENGTH
    tap_layers: tuple[int, ...] = KLEIN_TAP_LAYERS

    @classmethod
    def from_directory(cls, root: Path) -> "KleinText":
        from transformers import AutoTokenizer

        config = Qwen3Config.from_hf_dict(json.loads((root / "text_encoder" / "config.json").read_text()))
        return cls(AutoTokenizer.from_pretrained(root / "tokenizer"), config)

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt as the pipeline renders it: ``(input_ids [L], attention_mask [L])``."""
        ids, mask = _tokenize_chat(self.tokenizer, [prompt], self.max_length, enable_thinking=False,
                                   device=torch.device("cpu"))
        return ids[0], mask[0]

    def build_encoder(self) -> Qwen3TextEncoder:
        return Qwen3TextEncoder(self.config, tap_layers=self.tap_layers)

    def encode(self, encoder: Qwen3TextEncoder, ids: Sequence[torch.Tensor],
               masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A batch of tokenised prompts -> ``[L, taps * hidden]`` each (padding kept, as the
        pipeline gives all positions to the DiT)."""
        device = encoder.model.embed_tokens.weight.device
        with torch.inference_mode():
            states = encoder(torch.stack(list(ids)).to(device), torch.stack(list(masks)).to(device),
                             tap_layers=self.tap_layers)
        return list(torch.cat(states, dim=-1))
