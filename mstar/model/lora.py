"""LoRA adapters folded into a module's weights at load time.

A deployment lists adapters as ``[{path: ..., scale: ...}]`` (``parse_adapters``); each is read
from safetensors (``read_adapter``) and merged into the weights it targets (``fold_adapter``):

    W <- W + scale * s * (B @ A)        s = alpha / r   (rsLoRA: alpha / sqrt(r))

computed in float32 and rounded to the weight's dtype once, so the served model runs at the
base model's speed. ``r`` is the rank of each pair (the rows of ``A``); ``alpha`` follows PEFT:
an ``<module>.alpha`` tensor in the weights, else ``lora_alpha`` (per-module ``alpha_pattern``
first) of an ``adapter_config.json`` or ``config.json`` next to the weights, else ``alpha = r``.
The config's ``use_rslora`` switches to the rsLoRA scaling.

Key layouts: PEFT / diffusers (``<module>.lora_A.weight``, ``<module>.lora_B.weight``) and the
``lora_down`` / ``lora_up`` (or ``lora.down`` / ``lora.up``) spelling, under any of the usual
prefixes (``transformer.``, ``base_model.model.``, ``diffusion_model.``). A family whose
checkpoint layout differs from its module names passes ``targets``: a function from the
adapter's module name to the module names it updates, each with the share of the update's
output rows it takes (a fused ``qkv`` LoRA splits into ``q``, ``k`` and ``v``: chunks 0, 1 and
2 of 3).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["LoraAdapter", "LoraError", "LoraPair", "fold_adapter", "fold_adapters", "parse_adapters",
           "read_adapter"]

PREFIXES = ("base_model.model.", "transformer.", "diffusion_model.")
_WEIGHT_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
_CONFIG_FILES = ("adapter_config.json", "config.json")
_PAIR = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_down|lora_up|lora\.down|lora\.up)"
                   r"(\.[^.]+)?\.weight$")
_ALPHA = re.compile(r"^(?P<module>.+)\.alpha$")

# An adapter module name -> the target modules, each as (name, chunk, chunks): the target takes
# the chunk-th of ``chunks`` equal row blocks of the update ((name, 0, 1): all of it).
Targets = Callable[[str], Sequence[tuple[str, int, int]]]


class LoraError(ValueError):
    """An adapter that cannot be folded: the message names the deployment key and the rule."""


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    scale: float = 1.0


@dataclass
class LoraPair:
    """One low-rank update ``B @ A`` and its own scaling (``alpha / r``, or ``/ sqrt(r)``)."""

    down: torch.Tensor  # A: [r, in]
    up: torch.Tensor  # B: [out, r]
    scaling: float

    def delta(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The update ``scaling * B @ A`` in float32, ``[out, in]``, formed on ``device``."""
        return (self.up.to(device).float() @ self.down.to(device).float()) * self.scaling


def parse_adapters(value: Any, key: str = "model_kwargs.lora") -> list[LoraAdapter]:
    """The deployment's adapter list, checked: each entry ``{path, scale}`` (scale defaults to 1)."""
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, list):
        raise LoraError(f"{key}: must be a list of {{path, scale}} entries, got {type(value).__name__}")
    adapters = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
            raise LoraError(f"{where}: must be a mapping with a 'path' (a file or folder of LoRA safetensors)")
        unknown = set(entry) - {"path", "scale"}
        if unknown:
            raise LoraError(f"{where}: unknown keys {sorted(unknown)}; an entry takes 'path' and 'scale'")
        scale = entry.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise LoraError(f"{where}.scale: must be a finite number, got {scale!r}")
        adapters.append(LoraAdapter(entry["path"], float(scale)))
    return adapters


def adapter_file(path: str, key: str = "model_kwargs.lora") -> Path:
    """The safetensors file of an adapter: ``path`` itself, or the one weights file in a folder
    (a local folder or a Hugging Face id)."""
    location = Path(path).expanduser()
    if location.is_file():
        return location
    if not location.is_dir() and (location.is_absolute() or path.startswith((".", "~")) or location.suffix):
        raise LoraError(f"{key}: {path!r} is neither a file nor a folder")
    if not location.is_dir():
        from mstar.model.weights import ModelPathError, resolve_model_path

        try:
            location = resolve_model_path(path)
        except ModelPathError as err:
            raise LoraError(f"{key}: {path!r} is neither a file, a folder nor a reachable hub id ({err})") from None
    for name in _WEIGHT_FILES:
        if (location / name).is_file():
            return location / name
    found = sorted(location.glob("*.safetensors"))
    if len(found) != 1:
        raise LoraError(f"{key}: {str(location)!r} must hold one LoRA .safetensors file, found {len(found)}")
    return found[0]


def _adapter_config(weights: Path) -> dict[str, Any]:
    for name in _CONFIG_FILES:
        candidate = weights.parent / name
        if candidate.is_file():
            data = json.loads(candidate.read_text())
            if isinstance(data, dict) and ("lora_alpha" in data or "r" in data or "use_rslora" in data):
                return data
    return {}


def _strip(name: str, prefixes: Sequence[str]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _config_alpha(module: str, config: Mapping[str, Any]) -> float | None:
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            return float(alpha)
    alpha = config.get("lora_alpha")
    return None if alpha is None else float(alpha)


def read_adapter(path: str | Path, key: str = "model_kwargs.lora",
                 prefixes: Sequence[str] = PREFIXES) -> dict[str, LoraPair]:
    """The adapter's pairs by module name (the first of ``prefixes`` it starts with removed),
    each with its own scaling."""
    from safetensors.torch import load_file

    weights = adapter_file(str(path), key)
    tensors = load_file(str(weights))
    config = _adapter_config(weights)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, float] = {}
    for name, tensor in tensors.items():
        name = _strip(name, prefixes)
        if match := _PAIR.match(name):
            part = "down" if match["part"] in ("lora_A", "lora_down", "lora.down") else "up"
            halves.setdefault(match["module"], {})[part] = tensor
        elif match := _ALPHA.match(name):
            alphas[match["module"]] = float(tensor.float().item())
        else:
            raise LoraError(f"{key}: {weights.name} holds {name!r}, which is not a LoRA A/B weight or alpha "
                            "(DoRA and LoKr adapters are not supported)")
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"down", "up"}:
            raise LoraError(f"{key}: {weights.name} has only one half of the LoRA pair of {module!r}")
        down, up = half["down"], half["up"]
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
            raise LoraError(f"{key}: the LoRA pair of {module!r} has shapes {tuple(down.shape)} and "
                            f"{tuple(up.shape)}; expected [r, in] and [out, r]")
        rank = down.shape[0]
        alpha = alphas.get(module)
        if alpha is None:
            alpha = _config_alpha(module, config)
        if alpha is None:
            alpha = float(rank)
        root = math.sqrt(rank) if config.get("use_rslora") else rank
        pairs[module] = LoraPair(down, up, alpha / root)
    if not pairs:
        raise LoraError(f"{key}: {weights.name} holds no LoRA weights")
    return pairs


def fold_adapter(module: nn.Module, pairs: Mapping[str, LoraPair], scale: float = 1.0,
                 targets: Targets | None = None, key: str = "model_kwargs.lora") -> list[str]:
    """Add every pair's update (times ``scale``) to the weight it targets, in float32 with one
    rounding to the weight's dtype. Returns the updated module names. A pair whose target
    does not exist, or whose shape does not fit, raises ``LoraError`` before any weight changes."""
    modules = dict(module.named_modules())
    plan: list[tuple[nn.Linear, slice, LoraPair, str]] = []
    for name, pair in pairs.items():
        for target, chunk, chunks in (targets(name) if targets else [(name, 0, 1)]):
            layer = modules.get(target)
            if not isinstance(layer, nn.Linear):
                raise LoraError(f"{key}: the adapter targets {name!r}, but the model has no linear layer "
                                f"{target!r}")
            out = pair.up.shape[0]
            if out % chunks:
                raise LoraError(f"{key}: the LoRA update of {name!r} has {out} rows, not {chunks} equal parts")
            rows = slice(chunk * out // chunks, (chunk + 1) * out // chunks)
            if (out // chunks, pair.down.shape[1]) != tuple(layer.weight.shape):
                raise LoraError(f"{key}: the LoRA update of {name!r} is [{out // chunks}, {pair.down.shape[1]}]"
                                f" for {target!r}, whose weight is {list(layer.weight.shape)}")
            plan.append((layer, rows, pair, target))
    with torch.no_grad():
        for layer, rows, pair, _ in plan:
            weight = layer.weight
            delta = pair.delta(weight.device)[rows] * scale
            weight.copy_((weight.float() + delta).to(weight.dtype))
    return [target for *_, target in plan]


def fold_adapters(module: nn.Module, adapters: Sequence[LoraAdapter], targets: Targets | None = None,
                  key: str = "model_kwargs.lora") -> None:
    """Fold each adapter in order (their updates add up)."""
    for i, adapter in enumerate(adapters):
        fold_adapter(module, read_adapter(adapter.path, f"{key}[{i}]"), adapter.scale, targets, f"{key}[{i}]")
