"""Where BAGEL's config, tokenizer and weights come from: a directory laid out like the hub
snapshot of ByteDance-Seed/BAGEL-7B-MoT (or that hub id).

The snapshot holds ``config.json``, ``llm_config.json``, ``vit_config.json``, the Qwen2
tokenizer files, ``ema.safetensors`` (the whole model but the VAE) and ``ae.safetensors``
(the FLUX VAE, loaded by the generation side's module). ``ema.safetensors`` keys are the
official module names, grouped here by the part that loads them:

* ``llm`` (``BagelLanguageModel``): ``language_model.*``
* ``vision`` (``BagelVision``): ``vit_model.*``, ``connector.*``, ``vit_pos_embed.*``
* ``generation`` (the generation side's module, whose parameters carry the released names
  themselves): ``time_embedder.*``, ``vae2llm.*``, ``llm2vae.*``, ``latent_pos_embed.*``

``load_parts`` fills the parts it is given and checks coverage both ways over them: a
parameter nothing fills, or a tensor of none of the three parts, fails startup naming it;
the tensors of a part not loaded on this rank are skipped (and counted), as is the fixed
2D tables (``FIXED_TABLES``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mstar.model.bagel.config import BagelConfig
from mstar.model.bagel.llm import BagelLanguageModel
from mstar.model.bagel.prompt import SpecialTokens
from mstar.model.bagel.vision import BagelVision

log = logging.getLogger(__name__)

WEIGHTS_FILE = "ema.safetensors"
VAE_FILE = "ae.safetensors"
PART_PREFIXES: dict[str, tuple[str, ...]] = {
    "llm": ("language_model.",),
    "vision": ("vit_model.", "connector.", "vit_pos_embed."),
    "generation": ("time_embedder.", "vae2llm.", "llm2vae.", "latent_pos_embed."),
}
"""Which ``ema.safetensors`` keys each part loads (the generation side claims the last)."""
FIXED_TABLES = frozenset({"vit_pos_embed.pos_embed", "latent_pos_embed.pos_embed"})
"""Tensors skipped on purpose: the fixed sine-cosine tables of the vision and generation
sides, computed when their modules are built (``vision.PositionTable``,
``generation.LatentPositionEmbedding``). BAGEL never trains them, and released checkpoints
differ on whether they store them."""


def part_of(name: str) -> str | None:
    """The part that loads checkpoint tensor ``name`` (None: no part does)."""
    for part, prefixes in PART_PREFIXES.items():
        if name.startswith(prefixes):
            return part
    return None


@dataclass
class BagelCheckpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> BagelCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        missing = [f for f in ("llm_config.json", "vit_config.json") if not (path / f).is_file()]
        if missing:
            raise ValueError(f"model_path {path}: no {', '.join(missing)} (expected a BAGEL-7B-MoT directory)")
        return cls(path)

    def config(self) -> BagelConfig:
        return BagelConfig.from_dir(self.path)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @staticmethod
    def special_tokens(tokenizer) -> SpecialTokens:
        """BAGEL's four special ids; a tokenizer without them is refused, naming the token."""
        tokens = SpecialTokens.from_tokenizer(tokenizer)
        names = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
        for name, value in zip(names, (tokens.im_start, tokens.im_end, tokens.vision_start, tokens.vision_end),
                               strict=True):
            if value is None or value == tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no {name} token (one of BAGEL's four special tokens)")
        return tokens

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``ema.safetensors``' tensors (the VAE's ``ae.safetensors`` is not among them)."""
        from safetensors import safe_open

        file = self.path / WEIGHTS_FILE
        if not file.is_file():
            raise FileNotFoundError(f"model_path {self.path}: no {WEIGHTS_FILE}")
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)

    def load_models(self, device: torch.device, dtype: torch.dtype, *, llm: bool, vision: bool, dummy: bool,
                    seed: int) -> tuple[BagelLanguageModel | None, BagelVision | None]:
        """The language model (when ``llm``) and the vision side (when ``vision``) on ``device``
        in ``dtype``, with the checkpoint's weights or, when ``dummy``, seeded random ones (the
        LLM's seed ``seed``, the vision side's the next; the fixed 2D table is never drawn), in
        eval mode."""
        from mstar.model.weights import building, init_dummy_weights

        config = self.config()
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = BagelLanguageModel(config.llm) if llm else None
            tower = BagelVision(config) if vision else None
        parts = {name: m for name, m in (("llm", model), ("vision", tower)) if m is not None}
        if dummy:
            for i, module in enumerate(parts.values()):
                init_dummy_weights(module, seed=seed + i)
        else:
            load_parts(parts, self.tensors(), dtype)
        for module in parts.values():
            module.eval()
        return model, tower


class BagelParts(nn.Module):
    """The parts given to ``load_parts`` under the released names: the LLM as
    ``language_model``, the other parts' children at the root (so a parameter's name is its
    ``ema.safetensors`` key, and so is any name an error gives)."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for part, module in parts.items():
            if part == "llm":
                self.add_module("language_model", module)
                continue
            if any(True for _ in module.named_parameters(recurse=False)):
                raise ValueError(f"the {part} part must hold its parameters in children named as released")
            for name, child in module.named_children():
                self.add_module(name, child)


def load_parts(parts: dict[str, nn.Module], tensors, dtype: torch.dtype | None = None) -> None:
    """Load ``ema.safetensors``' ``tensors`` into ``parts`` (any of ``llm``, ``vision``,
    ``generation``; see ``PART_PREFIXES``), coverage checked both ways over the parts given.
    ``llm``'s parameters are named below ``language_model.``; the other parts' parameters carry
    the released names as they are."""
    from mstar.model.weights import load_weights

    unknown = set(parts) - set(PART_PREFIXES)
    if unknown:
        raise ValueError(f"unknown BAGEL parts {sorted(unknown)}; expected some of {sorted(PART_PREFIXES)}")
    root = BagelParts(parts)
    skipped: list[str] = []

    def name_map(name: str) -> str | None:
        part = part_of(name)
        if name in FIXED_TABLES or (part is not None and part not in parts):
            skipped.append(name)
            return None
        return name  # the released name is the parameter's (a stranger: load_weights names it)

    load_weights(root, tensors, name_map=name_map, dtype=dtype)
    if skipped:
        log.info("skipped %d checkpoint tensors of BAGEL parts not loaded here", len(skipped))
