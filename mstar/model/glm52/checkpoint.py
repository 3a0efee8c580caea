"""Where GLM-5.2's config, tokenizer and weights come from: the released directory
(``zai-org/GLM-5.2-FP8``: ``config.json``, the tokenizer, safetensors shards with fp8 weights
and their block scales).

The weights are ~750 GB: they are never downloaded automatically. ``model_path`` must be a
local directory, or a hub id already in the local hub cache; otherwise startup fails naming
``model_path`` and how to fetch them.

Keys load by name into ``Glm52ForCausalLM`` (coverage checked both ways), after the fp8
weights are dequantised (``fp8.dequantized``). The multi-token-prediction layers stored past
the decoder's (``model.layers.{num_hidden_layers + i}.*``, ``num_nextn_predict_layers`` of
them) are accepted and skipped: speculative decoding with them is not wired.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.glm52.config import Glm52Config
from mstar.model.glm52.fp8 import DEFAULT_BLOCK, attach_fp8_gemms, dequantized
from mstar.model.glm52.modeling import Glm52ForCausalLM
from mstar.model.weights import ModelPathError

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class Glm52Checkpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> Glm52Checkpoint:
        """The checkpoint at ``model_path``: a local directory, or a hub id found in the local
        cache (never fetched)."""
        local = Path(model_path).expanduser()
        if not local.exists():
            local = _cached_snapshot(model_path, cache_dir)
        if not (local / "config.json").is_file():
            raise ModelPathError(f"model_path {model_path!r}: {local} has no config.json")
        return cls(local)

    def raw_config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def config(self) -> Glm52Config:
        return Glm52Config.from_dict(self.raw_config())

    def fp8_block(self) -> tuple[int, int]:
        """The fp8 scale block (``quantization_config.weight_block_size``; 128 x 128)."""
        quant = self.raw_config().get("quantization_config") or {}
        return tuple(quant.get("weight_block_size", DEFAULT_BLOCK))

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def tensors(self, dtype: torch.dtype, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, fp8 weights dequantised to ``dtype`` (``keep``: see
        ``fp8.dequantized``)."""
        from mstar.model.weights import iter_safetensors

        return dequantized(iter_safetensors(self.path), dtype, self.fp8_block(), keep)

    def load_model(self, device: torch.device, dtype: torch.dtype, *, dummy: bool, seed: int,
                   fp8_gemm: bool = False) -> Glm52ForCausalLM:
        """The decoder on ``device`` in ``dtype`` (routers in float32), with the checkpoint's
        weights (or seeded random ones when ``dummy``), in eval mode. ``fp8_gemm``: the whole
        linear layers also keep their fp8 pairs as ``qweight`` (``fp8.attach_fp8_gemms``; the
        routed experts are not linears and stay dequantised)."""
        config = self.config()
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
            if fp8_gemm and weight.dim() == 2 and ".mlp.experts." not in name:
                pairs[name] = (weight, scale_inv)

        model = load_glm52(config, device, dtype, lambda: self.tensors(dtype, keep), dummy=dummy, seed=seed)
        if fp8_gemm and not dummy:
            attach_fp8_gemms(model, pairs, self.fp8_block())
        return model


def load_glm52(config: Glm52Config, device: torch.device, dtype: torch.dtype, tensors, *, dummy: bool,
               seed: int) -> Glm52ForCausalLM:
    """``Glm52ForCausalLM(config)`` on ``device`` filled from ``tensors()`` (released key names,
    unquantised), the MTP layers' keys skipped."""
    from mstar.model.weights import building, fill_weights

    with building(device, dtype):  # made in dtype at once (the routers in float32): no float32 copy
        model = Glm52ForCausalLM(config).to_dtype(dtype)  # a no-op here, kept as the contract
    log.info("loading GLM-5.2 weights (%s)", "dummy" if dummy else "checkpoint")
    # dtype None: each tensor takes its parameter's dtype (the routers stay in float32)
    return fill_weights(model, tensors, dummy=dummy, seed=seed, name_map=mtp_skipper(config))


def mtp_skipper(config: Glm52Config):
    """A ``name_map`` that skips the multi-token-prediction layers' keys (and only those)."""
    first, last = config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers

    def name_map(name: str) -> str | None:
        match = _LAYER.match(name)
        if match and first <= int(match.group(1)) < last:
            return None
        return name

    return name_map


def _cached_snapshot(model_path: str, cache_dir: str | None) -> Path:
    """A hub id's snapshot from the local cache only, or a ``ModelPathError`` naming ``model_path``."""
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(model_path, cache_dir=cache_dir, local_files_only=True))
    except Exception as exc:  # not cached (or not a repo id): say what to do
        raise ModelPathError(
            f"model_path {model_path!r} is not a local directory and not in the hub cache. GLM-5.2's weights "
            f"(~750 GB) are never downloaded automatically: fetch them (hf download zai-org/GLM-5.2-FP8 "
            f"--local-dir DIR) and set model_path to DIR ({type(exc).__name__})"
        ) from None
