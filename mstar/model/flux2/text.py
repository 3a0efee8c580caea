"""FLUX.2 [klein]'s text side, split the way the runtime needs it: the frontend tokenises
(chat template, padded to a fixed length), the text-encoder node runs only the Qwen3 layers
whose hidden states the DiT reads and concatenates them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.engine.cuda_graphs import ShapeGraphs
from mstar.model.qwen3 import (
    KLEIN_MAX_LENGTH,
    KLEIN_TAP_LAYERS,
    Qwen3Config,
    Qwen3TextEncoder,
)
from mstar.model.qwen3.klein import _tokenize_chat


@dataclass
class KleinText:
    tokenizer: Any
    config: Qwen3Config
    max_length: int = KLEIN_MAX_LENGTH
    tap_layers: tuple[int, ...] = KLEIN_TAP_LAYERS

    @classmethod
    def from_directory(cls, root: Path) -> KleinText:
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

    def encode(self, encoder: Qwen3TextEncoder, ids: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
               graphs: ShapeGraphs | None = None) -> list[torch.Tensor]:
        """A batch of tokenised prompts (on the host) -> ``[L, taps * hidden]`` each (padding
        kept, as the pipeline gives all positions to the DiT). Whether anything is padded is
        read on the host, so the forward never waits for the device; ``graphs`` (from
        ``graphed``) replays it from CUDA graphs."""
        ids, masks = torch.stack(list(ids)), torch.stack(list(masks))
        padded = not bool(masks.bool().all())
        device = encoder.model.embed_tokens.weight.device
        ids, masks = ids.to(device, non_blocking=True), masks.to(device, non_blocking=True)
        with torch.inference_mode():
            if graphs is None:
                features = self.features(encoder, ids, masks if padded else None)
            elif padded:
                features = graphs((tuple(ids.shape), True), ids, masks)
            else:
                features = graphs((tuple(ids.shape), False), ids)
        return list(features)

    def features(self, encoder: Qwen3TextEncoder, ids: torch.Tensor, masks: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The tapped hidden states side by side, ``[B, L, taps * hidden]``; ``masks`` None when
        nothing is padded (a forward free of host syncs, so it can be captured)."""
        states = encoder(ids, masks, tap_layers=self.tap_layers, padded=masks is not None)
        return torch.cat(states, dim=-1)

    def graphed(self, encoder: Qwen3TextEncoder) -> ShapeGraphs:
        """``features`` replayed from a CUDA graph per (batch, length, padded)."""
        device = encoder.model.embed_tokens.weight.device
        return ShapeGraphs(lambda ids, masks=None: self.features(encoder, ids, masks), device)
