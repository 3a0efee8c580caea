"""Z-Image's caption side, split the way the runtime needs it: the frontend tokenises (chat
template with thinking enabled, padded to 512), the text-encoder node runs the Qwen3 layers up
to the penultimate one and returns its hidden states (``ZImagePipeline._encode_prompt``).

The DiT reads only the real tokens of a caption. So that requests with prompts of different
lengths still batch at the DiT, the encoder node writes a fixed ``[max_length, hidden]`` tensor
(zeros after the caption) and the caption length travels as a request parameter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.qwen3 import (
    Z_IMAGE_MAX_LENGTH,
    Z_IMAGE_TAP_LAYER,
    Qwen3Config,
    Qwen3TextEncoder,
)
from mstar.model.qwen3.klein import _tokenize_chat


@dataclass
class ZImageText:
    tokenizer: Any
    config: Qwen3Config
    max_length: int = Z_IMAGE_MAX_LENGTH
    tap_layer: int = Z_IMAGE_TAP_LAYER

    @classmethod
    def from_directory(cls, root: Path) -> ZImageText:
        from transformers import AutoTokenizer

        config = Qwen3Config.from_hf_dict(json.loads((root / "text_encoder" / "config.json").read_text()))
        return cls(AutoTokenizer.from_pretrained(root / "tokenizer"), config)

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt as the pipeline renders it: ``(input_ids [L], attention_mask [L])``."""
        ids, mask = _tokenize_chat(self.tokenizer, [prompt], self.max_length, enable_thinking=True,
                                   device=torch.device("cpu"))
        return ids[0], mask[0]

    def build_encoder(self) -> Qwen3TextEncoder:
        return Qwen3TextEncoder(self.config, tap_layers=(self.tap_layer,))

    def encode(self, encoder: Qwen3TextEncoder, ids: Sequence[torch.Tensor],
               masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A batch of tokenised prompts -> ``[L, hidden]`` each: the tapped hidden states of the
        real tokens (in order, whatever the padding side), then zeros.

        With right padding a causal encoder's real positions never see the padding, so the
        stack runs only over the longest caption of the batch."""
        ids, masks = torch.stack(list(ids)), torch.stack(list(masks)).bool()
        longest = int(masks.sum(dim=1).max())
        span = ids.shape[1] if bool(masks[:, longest:].any()) else longest
        device = encoder.model.embed_tokens.weight.device
        ids, masks = ids[:, :span].to(device), masks[:, :span].to(device)
        with torch.inference_mode():
            (states,) = encoder(ids, masks, tap_layers=(self.tap_layer,))
        out = states.new_zeros(ids.shape[0], self.max_length, states.shape[-1])
        for row, (hidden, keep) in enumerate(zip(states, masks)):
            real = hidden[keep]
            out[row, : len(real)] = real
        return list(out)
