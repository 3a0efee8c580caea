"""Where a transducer checkpoint's config, front end, tokens and weights come from: a
Hugging Face directory (or hub id) in transformers' layout (``ParakeetForTDT``,
``Nemotron3_5AsrForRNNT``): ``config.json``, ``generation_config.json`` (optional),
``processor_config.json`` or ``preprocessor_config.json``, ``tokenizer.json`` and
safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.fastconformer.config import TransducerConfig
from mstar.model.fastconformer.features import MelSettings
from mstar.model.fastconformer.transducer import TransducerModel

# Nemotron ASR's released prompt dictionary (locale or bare code -> prompt index) and
# lookaheads, used when the checkpoint's processor_config.json does not carry its own.
NEMOTRON_LOOKAHEADS = (13, 6, 1, 0)
_NEMOTRON_LOCALES = {
    "en-US": 0, "en-GB": 1, "es-ES": 2, "es-US": 3, "zh-CN": 4, "zh-TW": 5, "hi-IN": 6, "ar-AR": 7, "fr-FR": 8,
    "de-DE": 9, "ja-JP": 10, "ru-RU": 11, "pt-BR": 12, "pt-PT": 13, "ko-KR": 14, "it-IT": 15, "nl-NL": 16,
    "pl-PL": 17, "tr-TR": 18, "uk-UA": 19, "ro-RO": 20, "el-GR": 21, "cs-CZ": 22, "hu-HU": 23, "sv-SE": 24,
    "da-DK": 25, "fi-FI": 26, "no-NO": 27, "sk-SK": 28, "hr-HR": 29, "bg-BG": 30, "lt-LT": 31, "th-TH": 32,
    "vi-VN": 33, "id-ID": 34, "ms-MY": 35, "bn-IN": 36, "ur-PK": 37, "fa-IR": 38, "ta-IN": 39, "te-IN": 40,
    "mr-IN": 41, "gu-IN": 42, "kn-IN": 43, "ml-IN": 44, "si-LK": 45, "ne-NP": 46, "km-KH": 47, "sw-KE": 48,
    "am-ET": 49, "ha-NG": 50, "zu-ZA": 51, "yo-NG": 52, "ig-NG": 53, "af-ZA": 54, "rw-RW": 55, "so-SO": 56,
    "ny-MW": 57, "ln-CD": 58, "or-KE": 59, "et-EE": 60, "lv-LV": 61, "sl-SI": 62, "he-IL": 64, "ku-TR": 65,
    "az-AZ": 66, "ka-GE": 67, "hy-AM": 68, "uz-UZ": 69, "tg-TJ": 70, "ky-KG": 71, "qu-PE": 80, "ay-BO": 81,
    "gn-PY": 82, "nah-MX": 83, "mi-NZ": 96, "haw-US": 97, "sm-WS": 98, "to-TO": 99, "fr-CA": 100, "auto": 101,
    "mt-MT": 102, "nb-NO": 103, "nn-NO": 104,
}
# bare codes: the locale each one means
_NEMOTRON_CODES = {"en": "en-US", "es": "es-US", "hi": "hi-IN", "ar": "ar-AR", "fr": "fr-FR", "de": "de-DE",
                   "ru": "ru-RU", "pt": "pt-PT", "ko": "ko-KR", "it": "it-IT", "nl": "nl-NL", "pl": "pl-PL",
                   "tr": "tr-TR", "uk": "uk-UA", "ro": "ro-RO", "el": "el-GR", "cs": "cs-CZ", "hu": "hu-HU",
                   "sv": "sv-SE", "da": "da-DK", "fi": "fi-FI", "no": "no-NO", "nb": "nb-NO", "nn": "nn-NO",
                   "sk": "sk-SK", "hr": "hr-HR", "bg": "bg-BG", "lt": "lt-LT", "et": "et-EE", "lv": "lv-LV",
                   "sl": "sl-SI"}
NEMOTRON_PROMPTS = _NEMOTRON_LOCALES | {code: _NEMOTRON_LOCALES[loc] for code, loc in _NEMOTRON_CODES.items()}


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class TransducerCheckpoint:
    directory: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> TransducerCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (a transformers transducer checkpoint)")
        return cls(path)

    def config(self) -> TransducerConfig:
        return TransducerConfig.from_hf_dict(_json(self.directory / "config.json"),
                                             _json(self.directory / "generation_config.json"))

    def processor(self) -> dict[str, Any]:
        """The processor's settings (``processor_config.json``, else ``preprocessor_config.json``)."""
        return _json(self.directory / "processor_config.json") or _json(self.directory / "preprocessor_config.json")

    def mel_settings(self, config: TransducerConfig) -> MelSettings:
        """The front end; Parakeet normalises each mel bin, the streaming encoder does not."""
        settings = MelSettings.from_preprocessor(self.processor() or {"feature_size": config.encoder.num_mel_bins},
                                                 normalize=not config.encoder.causal)
        if settings.n_mels != config.encoder.num_mel_bins:
            raise ValueError(f"the front end makes {settings.n_mels} mel bins but the encoder reads "
                             f"{config.encoder.num_mel_bins}")
        return settings

    def prompts(self) -> dict[str, int]:
        """Language prompt -> prompt index (Nemotron ASR), keys lowercased."""
        given = self.processor().get("prompt_dictionary") or NEMOTRON_PROMPTS
        return {name.lower(): int(index) for name, index in given.items()}

    def lookaheads(self) -> tuple[int, ...]:
        """The lookaheads the streaming encoder was trained with, widest first."""
        given = self.processor().get("supported_num_lookahead_tokens") or NEMOTRON_LOOKAHEADS
        return tuple(sorted((int(n) for n in given), reverse=True))

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.directory / "tokenizer.json"))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.directory)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> TransducerModel:
        """Encoder and transducer head on ``device`` in ``dtype`` with the checkpoint's weights
        (coverage checked both ways), or seeded random ones when ``dummy``; in eval mode."""
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = TransducerModel(self.config())
        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype)
