"""Where Qwen3-ASR's config, tokenizer and weights come from: a checkpoint directory (or hub
id) with ``config.json``, the tokenizer files and ``*.safetensors``, in either layout.

Weight names, both onto ours (``modeling.py``):

* released (``Qwen/Qwen3-ASR-1.7B``): ``thinker.audio_tower.*`` (the projector inside it as
  ``proj1`` / ``proj2``), ``thinker.model.*`` (the Qwen3 decoder) and ``thinker.lm_head.weight``;
* transformers' (``Qwen3ASRForConditionalGeneration``): ``model.audio_tower.*``,
  ``model.multi_modal_projector.linear_1`` / ``linear_2``, ``model.language_model.*`` and
  ``lm_head.weight``.

With tied embeddings an ``lm_head.weight`` (the embedding again) is skipped. Anything else is
loaded by its own name, so a tensor nothing reads fails startup naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.qwen3_asr.config import Qwen3ASRConfig
from mstar.model.qwen3_asr.modeling import Qwen3ASRModel

# what a dummy deployment reads of a hub checkpoint: its configs and tokenizer, not its weights
CONFIG_FILES = ("*.json", "*.txt", "*.jinja", "tokenizer*")

_PREFIXES = (
    ("thinker.audio_tower.proj1.", "multi_modal_projector.linear_1."),
    ("thinker.audio_tower.proj2.", "multi_modal_projector.linear_2."),
    ("thinker.audio_tower.", "audio_tower."),
    ("thinker.model.", "llm.model."),
    ("thinker.lm_head.", "llm.lm_head."),
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "llm.model."),
    ("lm_head.", "llm.lm_head."),
)


def our_name(name: str, tied: bool) -> str | None:
    """The parameter a checkpoint tensor (either layout) fills; None: not read."""
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            mapped = ours + name[len(prefix):]
            return None if tied and mapped == "llm.lm_head.weight" else mapped
    return name


@dataclass(frozen=True)
class Qwen3ASRCheckpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None, *, dummy: bool = False) -> Qwen3ASRCheckpoint:
        """``model_path`` (a directory, or a hub id resolved in the cache; with ``dummy`` only its
        config and tokenizer files are fetched)."""
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir, allow_patterns=CONFIG_FILES if dummy else None)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (expected a Qwen3-ASR checkpoint directory)")
        return cls(Path(path))

    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def config(self) -> Qwen3ASRConfig:
        return Qwen3ASRConfig.from_hf_dict(self.hf_config())

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.path)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> Qwen3ASRModel:
        from mstar.model.weights import building, fill_weights

        config = self.config()
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = Qwen3ASRModel(config)
        tied = config.llm.tie_word_embeddings
        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype,
                            name_map=lambda name: our_name(name, tied))


__all__ = ["CONFIG_FILES", "Qwen3ASRCheckpoint", "our_name"]
