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

# load(make, folder, seed offset, **load_weights options) -> the module ``make()`` builds, loaded
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

    def load(self, make: Callable[[], nn.Module], folder: str, *, device: torch.device, dtype: torch.dtype,
             dummy: bool, seed: int, fp32: Collection[str] = (), **load) -> nn.Module:
        """The module ``make()`` builds, made on ``device`` in ``dtype`` at once (``building``: no
        float32 copy first), with the weights of component ``folder`` (coverage checked both
        ways; ``load``: ``load_weights``' options), or seeded random weights when ``dummy``; in
        eval mode. A module that names its own checkpoint keys (``checkpoint_name_map``, the
        text encoders) is read through it unless ``name_map`` is given. ``fp32``: parameters
        with one of these names among the parts of their dotted name are float32 whatever
        ``dtype`` (diffusers' ``_keep_in_fp32_modules``), filled from the checkpoint without a
        round trip through ``dtype``."""
        from mstar.model.weights import building, fill_weights, iter_safetensors

        if isinstance(make, nn.Module):  # a module is callable too: name the mistake, not its forward's
            raise TypeError(f"load({folder!r}): give a factory (lambda: {type(make).__name__}(...)), not a "
                            "module built already, so it is made in the deployment's dtype")
        with building(device, dtype):
            module = make()
        keep = set(fp32)
        for name, param in module.named_parameters():
            if not keep.isdisjoint(name.split(".")):
                param.data = param.data.float()
        if "name_map" not in load and hasattr(module, "checkpoint_name_map"):
            load["name_map"] = module.checkpoint_name_map
        return fill_weights(module, lambda: iter_safetensors(self.root / folder), dummy=dummy, seed=seed,
                            dtype=None if fp32 else dtype, **load)

    def loader(self, config: DeploymentConfig, seed: int, device: torch.device) -> Loader:
        """``load(make, folder, offset, **options)`` for the deployment: its dtype, dummy or real
        weights, component seeds ``seed + offset`` (each component draws its own dummy weights)."""

        def load(make: Callable[[], nn.Module], folder: str, offset: int, **options) -> nn.Module:
            return self.load(make, folder, device=device, dtype=config.torch_dtype(),
                             dummy=config.load_format == "dummy", seed=seed + offset, **options)

        return load
