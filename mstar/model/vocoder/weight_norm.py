"""Folding weight-norm pairs of a checkpoint into plain weights.

Vocoder checkpoints store each weight-normed convolution as a magnitude ``g`` and a direction
``v`` (``weight = g * v / ||v||``, the norm taken over every dimension but 0): under the old
``torch.nn.utils.weight_norm`` names ``<m>.weight_g`` / ``<m>.weight_v`` (StyleTTS2, Kokoro)
or the parametrization names ``<m>.parametrizations.weight.original0`` / ``original1``
(newer HiFT code). Inference only ever needs the product, so our modules hold a plain
``<m>.weight`` and the checkpoint is folded once when it is read.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mstar.model.weights import WeightLoadError

__all__ = ["fold_weight_norm", "weight_norm_product"]

_PAIRS = (
    ("weight_g", "weight_v"),
    ("parametrizations.weight.original0", "parametrizations.weight.original1"),
)


def _base(name: str, suffix: str) -> str | None:
    """The module prefix of ``name`` if it ends in ``suffix`` (``""`` at top level), else None."""
    if name == suffix:
        return ""
    return name[: -len(suffix) - 1] if name.endswith("." + suffix) else None


def _join(base: str, leaf: str) -> str:
    return f"{base}.{leaf}" if base else leaf


def weight_norm_product(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``g * v / ||v||`` with the norm over every dimension of ``v`` but the first."""
    dims = tuple(range(1, v.dim()))
    return v * (g / v.norm(dim=dims, keepdim=True))


def fold_weight_norm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every ``(g, v)`` pair replaced by its ``<m>.weight``; a ``g`` without
    its ``v`` (or the reverse) is a ``WeightLoadError`` naming it."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for g_suffix, v_suffix in _PAIRS:
            if (base := _base(name, g_suffix)) is not None:
                partner = _join(base, v_suffix)
                if partner not in state:
                    raise WeightLoadError(f"weight-norm magnitude {name!r} has no direction {partner!r}")
                folded = weight_norm_product(tensor.float(), state[partner].float())
                out[_join(base, "weight")] = folded.to(state[partner].dtype)
                break
            if (base := _base(name, v_suffix)) is not None:
                partner = _join(base, g_suffix)
                if partner not in state:
                    raise WeightLoadError(f"weight-norm direction {name!r} has no magnitude {partner!r}")
                break
        else:
            out[name] = tensor
    return out
