"""Where a Canary checkpoint's config, front end, tokens and weights come from: a Hugging Face
directory (or hub id) in transformers' layout (``CanaryForConditionalGeneration``):
``config.json``, ``processor_config.json`` or ``preprocessor_config.json``, ``tokenizer.json``
and safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.canary.config import CanaryConfig
from mstar.model.canary.modeling import CanaryForConditionalGeneration
from mstar.model.fastconformer.features import MelSettings


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class CanaryCheckpoint:
    directory: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> CanaryCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (a transformers Canary checkpoint)")
        return cls(path)

    def config(self) -> CanaryConfig:
        return CanaryConfig.from_hf_dict(_json(self.directory / "config.json"))

    def mel_settings(self, config: CanaryConfig) -> MelSettings:
        """Parakeet's front end (per-bin normalised log-mels) at the encoder's mel bins."""
        processor = _json(self.directory / "processor_config.json") or _json(
            self.directory / "preprocessor_config.json") or {"feature_size": config.encoder.num_mel_bins}
        settings = MelSettings.from_preprocessor(processor, normalize=True)
        if settings.n_mels != config.encoder.num_mel_bins:
            raise ValueError(f"the front end makes {settings.n_mels} mel bins but the encoder reads "
                             f"{config.encoder.num_mel_bins}")
        return settings

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.directory / "tokenizer.json"))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        # NeMo's featurizer constants ride along in converted checkpoints; nothing reads them.
        return ((n, t) for n, t in iter_safetensors(self.directory) if not n.startswith("preprocessor.featurizer."))

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool,
                   seed: int) -> CanaryForConditionalGeneration:
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = CanaryForConditionalGeneration(self.config())
        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype)
