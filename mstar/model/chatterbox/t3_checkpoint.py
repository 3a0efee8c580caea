"""T3 weights from the released files, with coverage checked both ways, or dummy ones.

The released checkpoints name one file per variant, in the same directory as the rest of the
model (S3Gen, the voice encoder, the tokenizer):

* English (``ResembleAI/chatterbox``): ``t3_cfg.safetensors``, text ``tokenizer.json``;
* multilingual (same repository): ``t3_mtl23ls_v2.safetensors``,
  ``grapheme_mtl_merged_expanded_v1.json`` and the Chinese table ``Cangjie5_TC.json``;
* Turbo (``ResembleAI/chatterbox-turbo``): ``t3_turbo_v1.safetensors`` and a GPT-2 style
  tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``).

``T3TextFront`` reads the tokenizer files from the same directory.

The keys are ``T3``'s parameter names. Two released tensors are dropped on purpose, by name:
``text_head.weight`` (the text logits serve only a training loss) and Turbo's ``tfmr.wte.weight``
(GPT-2's token table, which T3 never reads: the reference deletes it after loading). Anything
else unused, and any parameter left unfilled, fails the load naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.model.chatterbox.config import T3Config
from mstar.model.chatterbox.t3 import T3
from mstar.model.chatterbox.text import (
    CangjieTable,
    GraphemeTokenizer,
    MultilingualTokenizer,
    TurboTokenizer,
    normalize_punctuation,
    t3_text_ids,
)
from mstar.model.weights import building, fill_weights

TEXT_FILES = {
    "english": "tokenizer.json",
    "multilingual": "grapheme_mtl_merged_expanded_v1.json",
}
CANGJIE_FILE = "Cangjie5_TC.json"
T3_FILES = {
    "english": "t3_cfg.safetensors",
    "multilingual": "t3_mtl23ls_v2.safetensors",
    "turbo": "t3_turbo_v1.safetensors",
}
UNUSED_KEYS = frozenset({"text_head.weight", "tfmr.wte.weight"})


def t3_name_map(name: str) -> str | None:
    """Released key -> parameter name (the same), or None for the tensors T3 does not use."""
    return None if name in UNUSED_KEYS else name


def t3_file(directory: str | Path, variant: str) -> Path:
    """The variant's T3 file in a checkpoint directory (``FileNotFoundError`` naming it)."""
    path = Path(directory) / T3_FILES[variant]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the {variant} T3 weights are {T3_FILES[variant]}")
    return path


def _tensors(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def load_t3(directory: str | Path | None, config: T3Config, *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, dummy: bool = False, seed: int = 0) -> T3:
    """``T3(config)`` on ``device`` in ``dtype`` (built in it: no float32 copy is held), filled
    from the variant's released file in ``directory`` (cast as the tensors are copied in) or,
    with ``dummy``, with seeded random weights of the real shapes."""
    with building(device, dtype):
        model = T3(config)
    path = None if dummy else t3_file(directory, config.variant)
    fill_weights(model, lambda: _tensors(path), dummy=dummy, seed=seed, name_map=t3_name_map)
    if dummy:  # the dummy fill zeroes 1-D tensors without "norm" in their name: GPT-2's ln_* scales
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                torch.nn.init.ones_(module.weight)
    return model


class T3TextFront:
    """A request's text to T3 text ids, the reference's way for the variant: punctuation
    tidied, tokenised (with the language for the multilingual model), start / stop text tokens
    around (not on Turbo). Built from the checkpoint directory's tokenizer files."""

    def __init__(self, directory: str | Path, config: T3Config) -> None:
        directory = Path(directory)
        self.config = config
        if config.variant == "turbo":
            self.tokenizer = TurboTokenizer(directory)
        elif config.variant == "multilingual":
            cangjie = directory / CANGJIE_FILE
            table = CangjieTable.from_file(cangjie) if cangjie.is_file() else None
            self.tokenizer = MultilingualTokenizer(directory / TEXT_FILES["multilingual"], table)
        else:
            self.tokenizer = GraphemeTokenizer(directory / TEXT_FILES["english"])

    def ids(self, text: str, language: str | None = None) -> list[int]:
        text = normalize_punctuation(text, self.config.variant)
        if isinstance(self.tokenizer, MultilingualTokenizer):
            ids = self.tokenizer.encode(text, language)
        else:
            ids = self.tokenizer.encode(text)
        return t3_text_ids(ids, self.config)


__all__ = ["T3_FILES", "TEXT_FILES", "T3TextFront", "UNUSED_KEYS", "load_t3", "t3_file", "t3_name_map"]
