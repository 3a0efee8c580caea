"""A diffusers-layout checkpoint: one folder per component (``text_encoder``, ``tokenizer``,
``transformer``, ``vae``, ``scheduler``), each with its ``config.json`` and safetensors. The
diffusion families' checkpoints (``Flux2Checkpoint``, ``ZImageCheckpoint``) add what their
components read from it."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
from torch import nn

from mstar.config import DeploymentConfig

# load(module, folder, seed offset, **load_weights options) -> the module, loaded
Loader = Callable[..., nn.Module]


@dataclass(frozen=True)
class DiffusersCheckpoint:
    root: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> Self:
        from mstar.model.weights import resolve_model_path

        return cls(resolve_model_path(model_path, cache_dir=cache_dir))

    def read_json(self, *parts: str) -> dict[str, Any]:
        return json.loads(self.root.joinpath(*parts).read_text())

    def load(self, module: nn.Module, folder: str, *, device: torch.device, dtype: torch.dtype, dummy: bool,
             seed: int, fp32: Collection[str] = (), **load) -> nn.Module:
        """``module`` on ``device`` in ``dtype`` with the weights of component ``folder``
        (coverage checked both ways; ``load``: ``load_weights``' options), or seeded random
        weights when ``dummy``; in eval mode. ``fp32``: parameters with one of these names among
        the parts of their dotted name stay in float32 whatever ``dtype`` (diffusers'
        ``_keep_in_fp32_modules``), filled from the checkpoint without a round trip through ``dtype``."""
        from mstar.model.weights import fill_weights, iter_safetensors

        module = module.to(device=device, dtype=dtype)
        keep = set(fp32)
        for name, param in module.named_parameters():
            if not keep.isdisjoint(name.split(".")):
                param.data = param.data.float()
        return fill_weights(module, lambda: iter_safetensors(self.root / folder), dummy=dummy, seed=seed,
                            dtype=None if fp32 else dtype, **load)

    def loader(self, config: DeploymentConfig, seed: int, device: torch.device) -> Loader:
        """``load(module, folder, offset, **options)`` for the deployment: its dtype, dummy or real
        weights, component seeds ``seed + offset`` (each component draws its own dummy weights)."""

        def load(module: nn.Module, folder: str, offset: int, **options) -> nn.Module:
            return self.load(module, folder, device=device, dtype=config.torch_dtype(),
                             dummy=config.load_format == "dummy", seed=seed + offset, **options)

        return load
