"""Where Canary-Qwen's config, front end, tokens and weights come from: the released NeMo
``SALM`` directory (or hub id), ``config.json`` (the NeMo model config) and
``model.safetensors``, plus the LLM it names (``pretrained_llm``, Qwen/Qwen3-1.7B: its
``config.json``, ``tokenizer.json`` and ``tokenizer_config.json``), read from an ``llm/``
folder of the checkpoint when there is one, else from that hub id or directory, as NeMo does.

Weight names (NeMo's, from its source; the real file was not reachable to check):

* ``perception.encoder.*`` and ``perception.modality_adapter.*``: NeMo ``ConformerEncoder``
  names, mapped onto ours as transformers' Parakeet converter maps them (``pre_encode.conv.N``
  -> ``subsampling.layers.N``, ``pre_encode.out`` -> ``subsampling.linear``, the adapter's
  linear ``pre_encode`` -> ``subsampling.linear``, ``linear_q/k/v/out/pos`` ->
  ``q/k/v/o_proj``/``relative_k_proj``, ``pos_bias_u/v`` -> ``bias_u/v``, ``conv.batch_norm``
  -> ``conv.norm``); ``perception.proj.*`` as is; ``perception.preprocessor.*`` (the mel
  window and filterbank) is not read: the front end is recomputed (``features.py``).
* ``embed_tokens.weight``: the LLM's token embedding, which SALM keeps outside the LLM.
* ``llm.base_model.model.*`` (PEFT's wrapper; plain ``llm.*`` too): the Qwen3 weights.
  A LoRA-wrapped projection is ``<module>.base_layer.weight`` with ``<module>.lora_A.<name>.weight``
  ``[r, in]`` and ``<module>.lora_B.<name>.weight`` ``[out, r]``; they are merged here into
  ``<module>.weight = W + scaling * B @ A`` (float32, rounded once by the loader). With tied
  embeddings an ``lm_head.weight`` (the embedding again) is skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.model.canary_qwen.config import CanaryQwenConfig
from mstar.model.canary_qwen.modeling import CanaryQwenModel
from mstar.model.fastconformer.nemo_names import conformer_renamer

_LORA = re.compile(r"^(?P<module>.+)\.(?:base_layer\.(?P<base>weight|bias)|lora_(?P<part>[AB])\.[^.]+\.weight)$")
# a NeMo ``ConformerEncoder`` parameter name (under the encoder) as ours
conformer_name = conformer_renamer((
    (r"^pre_encode\.conv\.", "subsampling.layers."), (r"^pre_encode\.out\.", "subsampling.linear."),
    (r"^pre_encode\.(weight|bias)$", r"subsampling.linear.\1")))


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def our_name(name: str, tied: bool) -> str | None:
    """The parameter a released tensor fills (None: not read)."""
    for prefix, ours in (("perception.encoder.", "encoder."), ("perception.modality_adapter.", "adapter.")):
        if name.startswith(prefix):
            return ours + conformer_name(name[len(prefix):])
    if name.startswith("perception.preprocessor."):
        return None
    if name.startswith("perception.proj."):
        return name[len("perception."):]
    if name == "embed_tokens.weight":
        return "llm.model.embed_tokens.weight"
    for prefix in ("llm.base_model.model.", "llm."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return None if tied and rest == "lm_head.weight" else "llm." + rest
    return name


@dataclass
class CanaryQwenCheckpoint:
    directory: Path
    cache_dir: str | None = None

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> CanaryQwenCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (a NeMo SALM checkpoint)")
        return cls(path, cache_dir)

    def nemo_config(self) -> dict[str, Any]:
        return _json(self.directory / "config.json")

    def llm_directory(self) -> Path:
        """The LLM's files: the checkpoint's ``llm/`` folder, else ``pretrained_llm``."""
        from mstar.model.weights import resolve_model_path

        local = self.directory / "llm"
        if (local / "config.json").is_file():
            return local
        name = self.nemo_config().get("pretrained_llm", "Qwen/Qwen3-1.7B")
        path = resolve_model_path(name, cache_dir=self.cache_dir,
                                  allow_patterns=["*.json", "*.txt", "merges.txt", "vocab.json"])
        if not (path / "config.json").is_file():
            raise ValueError(f"pretrained_llm {name!r}: no config.json at {path}")
        return path

    def config(self) -> CanaryQwenConfig:
        return CanaryQwenConfig.from_nemo(self.nemo_config(), _json(self.llm_directory() / "config.json"))

    def tokenizer(self, config: CanaryQwenConfig):
        """The LLM's tokenizer with the audio locator tag added as a special token (as SALM
        adds it), and its end-of-turn token (``eos_token``, ``<|im_end|>`` for Qwen3)."""
        from tokenizers import Tokenizer

        own = self.directory / "tokenizer.json"
        llm = self.llm_directory()
        tokenizer = Tokenizer.from_file(str(own if own.is_file() else llm / "tokenizer.json"))
        if tokenizer.token_to_id(config.audio_locator_tag) is None:
            tokenizer.add_special_tokens([config.audio_locator_tag])
        eos = _json(llm / "tokenizer_config.json").get("eos_token") or "<|im_end|>"
        if isinstance(eos, dict):
            eos = eos.get("content")
        return tokenizer, eos

    def tensors(self, config: CanaryQwenConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Released tensors, LoRA pairs merged into their base weights (``<module>.weight``);
        ``our_name`` maps the names onto our parameters."""
        from mstar.model.weights import WeightLoadError, iter_safetensors

        wrapped: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in iter_safetensors(self.directory):
            match = _LORA.match(name)
            if match is None:
                yield name, tensor
                continue
            wrapped.setdefault(match["module"], {})[match["base"] or match["part"]] = tensor
        for module, parts in wrapped.items():
            lora = {"A", "B"} & parts.keys()
            if "weight" not in parts or (lora and lora != {"A", "B"}):
                missing = sorted({"weight", "A", "B"} - parts.keys())
                raise WeightLoadError(f"{module}: a LoRA-wrapped layer without its {', '.join(missing)} tensor(s)")
            weight = parts["weight"]
            if lora:
                if config.lora is None:
                    raise WeightLoadError(f"{module}.lora_A: LoRA weights but no lora section in config.json")
                delta = parts["B"].float() @ parts["A"].float()
                if delta.shape != weight.shape:
                    raise WeightLoadError(f"{module}: LoRA update {tuple(delta.shape)} for a weight of "
                                          f"{tuple(weight.shape)}")
                weight = weight.float() + config.lora.scaling * delta
            yield f"{module}.weight", weight
            if "bias" in parts:
                yield f"{module}.bias", parts["bias"]

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> CanaryQwenModel:
        from mstar.model.weights import building, fill_weights

        config = self.config()
        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = CanaryQwenModel(config)
        tied = config.llm.tie_word_embeddings
        return fill_weights(model, lambda: self.tensors(config), dummy=dummy, seed=seed, dtype=dtype,
                            name_map=lambda name: our_name(name, tied))
