"""Where Orpheus's weights come from: the talker is a Llama checkpoint (``LlamaCheckpoint``);
the SNAC codec is a checkpoint in the layout of ``hubertsiuzdak/snac_24khz`` (``config.json``
and a ``pytorch_model.bin`` state dict), loaded in float32 (its convolutions are small; bf16
costs quality for little speed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.llama.checkpoint import LlamaCheckpoint
from mstar.model.snac import SnacConfig, SnacDecoder, load_snac_state_dict


@dataclass(frozen=True)
class OrpheusCheckpoint:
    model_path: str  # the talker: a Hugging Face id or a directory
    snac_path: str  # the codec: a Hugging Face id or a directory
    cache_dir: str | None = None

    def talker(self) -> LlamaCheckpoint:
        return LlamaCheckpoint.locate(self.model_path, self.cache_dir)

    def snac(self, device: torch.device) -> SnacDecoder:
        """The codec with its checkpoint's weights (weight norm folded), in eval mode."""
        from mstar.model.weights import resolve_model_path

        path = Path(resolve_model_path(self.snac_path, cache_dir=self.cache_dir))
        with torch.device(device):
            decoder = SnacDecoder(SnacConfig.from_dict(json.loads((path / "config.json").read_text())))
        state = torch.load(path / "pytorch_model.bin", map_location=device, weights_only=True)
        load_snac_state_dict(decoder, state)
        decoder.fuse_weight_norm()
        return decoder.eval()


def dummy_snac(config: dict[str, Any], device: torch.device, seed: int) -> SnacDecoder:
    """A codec of ``config`` (SNAC's ``config.json`` keys) with seeded random weights, weight
    norm folded as ``snac`` folds a checkpoint's (so a dummy deployment runs what a real one
    does)."""
    from mstar.model.weights import init_dummy_weights

    with torch.device(device):
        decoder = SnacDecoder(SnacConfig.from_dict(config))
    init_dummy_weights(decoder, seed=seed)
    decoder.fuse_weight_norm()
    return decoder.eval()
