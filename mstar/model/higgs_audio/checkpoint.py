"""Where Higgs Audio v3 STT's config, tokens and weights come from: the release's directory
(or hub id) with ``config.json``, ``tokenizer.json`` and safetensors (one file or shards).

Released names (from public code that loads the checkpoint; the files themselves were not
reachable to check): ``audio_tower.*`` and ``audio_encoder_proj.*`` as ours; the LLM at the
top level, ``embed_tokens.weight``, ``layers.N.*`` and ``norm.weight`` (ours under
``llm.model.``), its output head ``audio_decoder_proj.text_lm_head.weight`` (ours
``llm.lm_head.weight``). The audio-out side the checkpoint also carries
(``audio_decoder_proj.audio_lm_head.weight``, ``audio_codebook_embeddings.weight``) is not
read; any other tensor, or a parameter nothing fills, fails the load naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.higgs_audio.config import HiggsAudioConfig
from mstar.model.higgs_audio.modeling import HiggsAudioModel

UNUSED = frozenset({"audio_decoder_proj.audio_lm_head.weight", "audio_codebook_embeddings.weight"})


def our_name(name: str) -> str | None:
    """The parameter a released tensor fills (None: not read)."""
    if name in UNUSED:
        return None
    if name == "audio_decoder_proj.text_lm_head.weight":
        return "llm.lm_head.weight"
    if name in ("embed_tokens.weight", "norm.weight") or name.startswith("layers."):
        return "llm.model." + name
    return name


@dataclass
class HiggsAudioCheckpoint:
    directory: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> HiggsAudioCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (a Higgs Audio v3 STT checkpoint)")
        return cls(path)

    def config(self) -> HiggsAudioConfig:
        return HiggsAudioConfig.from_hf_dict(json.loads((self.directory / "config.json").read_text()))

    def tokenizer(self):
        from tokenizers import Tokenizer

        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model_path {self.directory}: no tokenizer.json")
        return Tokenizer.from_file(str(path))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.directory)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> HiggsAudioModel:
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = HiggsAudioModel(self.config())
        return fill_weights(model, self.tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=our_name)
