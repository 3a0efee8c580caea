"""Where a Nemotron-H model's config, tokenizer and weights come from, and how checkpoint
tensor names map onto ``NemotronHForCausalLM``.

The released checkpoints keep the model under ``backbone.`` (``backbone.embeddings``,
``backbone.layers.<i>.{norm,mixer}``, ``backbone.norm_f``) with ``lm_head.weight`` beside
it; a checkpoint saved by transformers 5 has ``model.`` in place of ``backbone.``. The
multi-token-prediction layers (``mtp.*``) are never loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.hf_config import generation_eos
from mstar.model.nemotron_h.config import NemotronHConfig
from mstar.model.nemotron_h.modeling import NemotronHForCausalLM

IGNORED_PREFIXES = ("mtp.",)


def checkpoint_name(name: str, tie_word_embeddings: bool) -> str | None:
    """Our parameter name for checkpoint tensor ``name`` (None: not loaded)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith("model."):
        return "backbone." + name[len("model."):]
    if name == "lm_head.weight" and tie_word_embeddings:
        return None  # a tied checkpoint that still stores the head: the embeddings are it
    return name


def load_checkpoint(model: NemotronHForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                    dtype: torch.dtype | None = None) -> None:
    """Load ``tensors`` into ``model``, coverage checked both ways (``WeightLoadError``
    names a parameter nothing fills or a tensor that fills nothing)."""
    from mstar.model.weights import load_weights

    tied = model.config.tie_word_embeddings
    load_weights(model, tensors, name_map=lambda name: checkpoint_name(name, tied), dtype=dtype)


@dataclass
class NemotronHCheckpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> NemotronHCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (expected a Hugging Face Nemotron-H directory)")
        return cls(path)

    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def config(self) -> NemotronHConfig:
        return NemotronHConfig.from_hf_dict(self.hf_config())

    def generation_eos(self) -> list[int]:
        return generation_eos(self.path)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.path)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool = False,
                   seed: int = 0) -> NemotronHForCausalLM:
        """The model on ``device`` in ``dtype`` with the checkpoint's weights, or seeded
        random ones (``dummy``), in eval mode."""
        from mstar.model.weights import building, init_dummy_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = NemotronHForCausalLM(self.config())
        if dummy:
            init_dummy_weights(model, seed=seed)
        else:
            load_checkpoint(model, self.tensors(), dtype)
        return model.eval()
