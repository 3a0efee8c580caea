"""Where Pi0.5's config, weights, tokenizer and normalisation statistics come from: a lerobot
policy directory (``lerobot/pi05_base`` in the hub cache, or a local one) holding

* ``config.json`` (``"type": "pi05"``: ``Pi05Config.from_lerobot``),
* ``model.safetensors`` in lerobot's key layout (``paligemma_with_expert.*``, ``action_in_proj``,
  ``action_out_proj``, ``time_mlp_in``/``_out``; some exports prefix every key with ``model.``),
* ``policy_preprocessor.json`` / ``policy_postprocessor.json``: the processor pipelines, whose
  normaliser steps name a ``state_file`` of statistics (``observation.state.q01``,
  ``action.q99``, ...) and a ``norm_map`` saying which statistics apply (Pi0.5: quantiles for
  state and action).

The released weights store the language model's embedding only as the tied
``paligemma.lm_head.weight`` (loaded into ``embed_tokens``) and carry the action expert's unused
``lm_head`` (skipped). The tokenizer is PaliGemma's: taken from the directory when it has one,
else from ``tokenizer`` (a hub id or path, ``google/paligemma-3b-pt-224`` by default, as lerobot
does).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.pi05.config import Pi05Config
from mstar.model.pi05.modeling import Pi05Policy

log = logging.getLogger(__name__)

DEFAULT_TOKENIZER = "google/paligemma-3b-pt-224"
_ROOTS = ("paligemma_with_expert.", "action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out.")
_EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
_LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
_EXPERT_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"


@dataclass(frozen=True)
class Normalizer:
    """One feature's normalisation as lerobot's ``NormalizerProcessorStep`` does it: ``mode`` is
    ``IDENTITY``, ``MEAN_STD``, ``MIN_MAX``, ``QUANTILES`` (q01/q99 to [-1, 1]) or ``QUANTILE10``
    (q10/q90); ``stats`` are float32 vectors of the embodiment's width."""

    mode: str
    stats: dict[str, torch.Tensor]
    eps: float = 1e-8

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}[self.mode]
        lo, hi = self.stats[low], self.stats[high]
        span = hi - lo
        return lo, torch.where(span == 0, torch.tensor(self.eps, dtype=span.dtype), span)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return (x - self.stats["mean"]) / (self.stats["std"] + self.eps)
        lo, span = self._range()
        return 2.0 * (x - lo) / span - 1.0

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return x * self.stats["std"] + self.stats["mean"]
        lo, span = self._range()
        return (x + 1.0) * span / 2.0 + lo

    @property
    def width(self) -> int | None:
        return None if not self.stats else int(next(iter(self.stats.values())).shape[-1])


IDENTITY = Normalizer("IDENTITY", {})


@dataclass(frozen=True)
class Embodiment:
    """A robot's statistics: its state is normalised with ``state`` before it enters the prompt,
    its actions leave through ``action``."""

    state: Normalizer
    action: Normalizer


def read_embodiment(directory: Path) -> Embodiment:
    """The normaliser steps of a lerobot policy directory's processor pipelines (identity for a
    feature no step covers, or when the directory has no pipelines)."""
    found: dict[str, Normalizer] = {}
    for pipeline in ("policy_preprocessor.json", "policy_postprocessor.json"):
        path = directory / pipeline
        if not path.is_file():
            continue
        for step in json.loads(path.read_text()).get("steps", []):
            if step.get("registry_name") not in ("normalizer_processor", "unnormalizer_processor"):
                continue
            if "state_file" not in step:
                continue
            from safetensors.torch import load_file

            stats = load_file(str(directory / step["state_file"]))
            config = step.get("config", {})
            norm_map = config.get("norm_map", {})
            for feature, kind in (("observation.state", "STATE"), ("action", "ACTION")):
                prefix = feature + "."
                mine = {k[len(prefix):]: v.float() for k, v in stats.items() if k.startswith(prefix)}
                if mine and feature not in found:
                    found[feature] = Normalizer(norm_map.get(kind, "IDENTITY"), mine, float(config.get("eps", 1e-8)))
    return Embodiment(found.get("observation.state", IDENTITY), found.get("action", IDENTITY))


@dataclass
class Pi05Checkpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> Pi05Checkpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (a lerobot Pi0.5 policy directory)")
        return cls(path)

    def config(self) -> Pi05Config:
        return Pi05Config.from_lerobot(json.loads((self.path / "config.json").read_text()))

    def embodiment(self) -> Embodiment:
        return read_embodiment(self.path)

    def tokenizer(self, name: str | None = None):
        from transformers import AutoTokenizer

        if any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            return AutoTokenizer.from_pretrained(self.path)
        from mstar.model.weights import resolve_model_path

        return AutoTokenizer.from_pretrained(resolve_model_path(name or DEFAULT_TOKENIZER))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.path)

    def name_map(self):
        """Checkpoint key -> parameter name: a leading ``model.`` dropped, the tied
        ``lm_head`` into ``embed_tokens`` (unless the embedding is stored too), the expert's
        ``lm_head`` skipped."""
        from safetensors import safe_open

        from mstar.model.weights import _safetensors_files

        keys = set()
        for file in _safetensors_files(self.path):
            with safe_open(file, framework="pt") as handle:
                keys.update(strip_model_prefix(k) for k in handle.keys())
        return make_name_map(embedding_stored=_EMBED in keys)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> Pi05Policy:
        """The policy on ``device`` in ``dtype`` with the checkpoint's weights (coverage checked
        both ways) or seeded random ones (``dummy``), in eval mode."""
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = Pi05Policy(self.config())
        log.info("loading %s weights (%s)", self.path, "dummy" if dummy else "safetensors")
        name_map = None if dummy else self.name_map()
        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=name_map)


def strip_model_prefix(key: str) -> str:
    if key.startswith("model.") and key[len("model."):].startswith(_ROOTS):
        return key[len("model."):]
    return key


def make_name_map(*, embedding_stored: bool):
    def name_map(key: str) -> str | None:
        key = strip_model_prefix(key)
        if key == _EXPERT_HEAD:
            return None
        if key == _LM_HEAD:
            return None if embedding_stored else _EMBED
        return key

    return name_map
