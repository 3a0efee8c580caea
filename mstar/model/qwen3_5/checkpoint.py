"""Where a Qwen3.5 model's config, tokenizer and weights come from, and how the
checkpoint's tensor names map onto ``Qwen3_5ForCausalLM``.

The released checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): the text
model under ``model.language_model.``, the vision tower under ``model.visual.``, the
multi-token-prediction head under ``mtp.``, and ``lm_head.weight``. A text-only checkpoint
(transformers' ``Qwen3_5ForCausalLM``) has the text model under ``model.``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.hf_config import generation_eos
from mstar.model.qwen3_5.config import Qwen3_5Config, Qwen3_5VisionConfig
from mstar.model.qwen3_5.modeling import Qwen3_5ForCausalLM
from mstar.model.qwen3_5.vision import Qwen3_5VisionModel

log = logging.getLogger(__name__)

TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
# Never loaded, on purpose: the multi-token-prediction head (speculative decoding is not
# implemented). The vision tower loads into its own module (``vision_name``).
IGNORED_PREFIXES = ("mtp.",)


def checkpoint_name(name: str, tie_word_embeddings: bool) -> str | None:
    """Our text model's parameter name for checkpoint tensor ``name``; None when the text
    model does not take it (the vision tower's tensors, the MTP head, a tied head)."""
    if name.startswith(IGNORED_PREFIXES) or name.startswith(VISION_PREFIX):
        return None
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX):]
    if name == "lm_head.weight" and tie_word_embeddings:
        return None  # some tied checkpoints still store the head: the embeddings are it
    return name


def vision_name(name: str) -> str | None:
    """The vision tower's parameter name for checkpoint tensor ``name`` (None: not its)."""
    return name[len(VISION_PREFIX):] if name.startswith(VISION_PREFIX) else None


@dataclass
class Qwen3_5Checkpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> Qwen3_5Checkpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (expected a Hugging Face Qwen3.5 directory)")
        return cls(path)

    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def config(self) -> Qwen3_5Config:
        return Qwen3_5Config.from_hf_dict(self.hf_config())

    def vision_config(self) -> Qwen3_5VisionConfig | None:
        """The ViT tower's config; None for a text-only checkpoint."""
        return Qwen3_5VisionConfig.from_hf_dict(self.hf_config())

    def processor_config(self, kind: str) -> dict[str, Any]:
        """``preprocessor_config.json`` (kind ``image``) or ``video_preprocessor_config.json``
        (``video``); empty when the checkpoint has none."""
        file = self.path / ("preprocessor_config.json" if kind == "image" else "video_preprocessor_config.json")
        return json.loads(file.read_text()) if file.is_file() else {}

    def generation_eos(self) -> list[int]:
        """``eos_token_id`` of ``generation_config.json`` (the chat stop tokens), if any."""
        return generation_eos(self.path)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.path)

    def load_models(self, device: torch.device, dtype: torch.dtype, *, text: bool, vision: bool, dummy: bool,
                    seed: int) -> tuple[Qwen3_5ForCausalLM | None, Qwen3_5VisionModel | None]:
        """The text model (when ``text``) and the ViT tower (when ``vision``) on ``device`` in
        ``dtype``, with the checkpoint's weights (or seeded random ones when ``dummy``: the
        text model's seed ``seed``, the tower's the next), in eval mode."""
        from mstar.model.weights import building, init_dummy_weights

        vision_config = self.vision_config()
        if vision and vision_config is None:
            raise ValueError(f"node 'vision' is placed, but {self.path} has no vision_config")
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = Qwen3_5ForCausalLM(self.config()) if text else None
            tower = Qwen3_5VisionModel(vision_config) if vision else None
        modules = [m for m in (model, tower) if m is not None]
        if dummy:
            for i, module in enumerate(modules):
                init_dummy_weights(module, seed=seed + i)
        else:
            load_checkpoint(model, self.tensors(), dtype, visual=tower)
        for module in modules:
            module.eval()
        return model, tower


def load_checkpoint(model, tensors, dtype: torch.dtype | None = None, *, visual=None) -> None:
    """Load a Qwen3.5 checkpoint (multimodal or text-only layout) into ``Qwen3_5ForCausalLM``
    (``model``) and, if given, the ViT tower (``visual``, from ``model.visual.*``), coverage
    checked both ways over what is loaded. Either may be None (a rank holding only the other
    node): that part's tensors are skipped, like the MTP head and a tied head, and counted."""
    from torch import nn

    from mstar.model.weights import load_weights

    tied = model is not None and model.config.tie_word_embeddings
    skipped: list[str] = []

    def name_map(name: str) -> str | None:
        if name.startswith("model.visual."):
            ours = None if visual is None else "visual." + vision_name(name)
        else:
            ours = None if model is None else checkpoint_name(name, tied)
            ours = None if ours is None else "llm." + ours
        if ours is None:
            skipped.append(name)
        elif target is not parts:
            ours = ours.split(".", 1)[1]
        return ours

    parts = nn.Module()
    for name, module in (("llm", model), ("visual", visual)):
        if module is not None:
            parts.add_module(name, module)
    target = model if visual is None else visual if model is None else parts
    load_weights(target, tensors, name_map=name_map, dtype=dtype)
    if skipped:
        log.info("skipped %d checkpoint tensors not loaded here (MTP head, tied head, a node on another rank)",
                 len(skipped))
