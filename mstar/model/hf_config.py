"""Reading and writing Hugging Face ``config.json`` dicts: the RoPE part, in both the
transformers 5 form (``rope_parameters``) and the older ``rope_theta`` / ``rope_scaling``; and
diffusers components' configs as dataclasses (``DiffusersConfig``)."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, ClassVar, Self

ROPE_FIELDS = ("rope_theta", "rope_scaling")


class DiffusersConfig:
    """A dataclass config of a diffusers component (``diffusers_class`` names it in errors), read
    from its ``config.json`` dict: ``_``-prefixed metadata keys (``_class_name``,
    ``_diffusers_version``) ignored, other unknown keys refused; written back with the diffusers
    constructor's keyword names, tuples as lists."""

    diffusers_class: ClassVar[str]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if not k.startswith("_")}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown {cls.diffusers_class} config keys: {unknown}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def config_kwargs(cls, d: dict[str, Any], nullable: set[str]) -> dict[str, Any]:
    """The dataclass ``cls``'s keyword arguments from a HF dict: known keys only, ``None``
    kept only for ``nullable`` keys, RoPE settings read from either form."""
    names = {f.name for f in fields(cls)} - set(ROPE_FIELDS)
    kwargs = {k: d[k] for k in names if k in d and (d[k] is not None or k in nullable)}
    rope_params = d.get("rope_parameters")
    if isinstance(rope_params, dict) and rope_params:
        theta = rope_params.get("rope_theta", d.get("rope_theta"))
        kwargs["rope_scaling"] = rope_params
    else:
        theta = d.get("rope_theta")
        kwargs["rope_scaling"] = d.get("rope_scaling")
    if theta is not None:
        kwargs["rope_theta"] = float(theta)
    return kwargs


def config_dict(config, architecture: str, model_type: str) -> dict[str, Any]:
    """A HF ``config.json`` dict of a dataclass config, RoPE as ``rope_parameters``."""
    out: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for f in fields(config):
        if f.name not in ROPE_FIELDS:
            out[f.name] = getattr(config, f.name)
    rope: dict[str, Any] = {"rope_type": "default"}
    rope.update(config.rope_scaling or {})
    rope["rope_theta"] = config.rope_theta
    out["rope_parameters"] = rope
    return out


def normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Canonical ``rope_scaling``: ``None`` for plain RoPE, else a dict keyed by ``rope_type``
    (the legacy ``type`` key is renamed, ``rope_theta`` is dropped)."""
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    out["rope_type"] = rope_type
    return out


def generation_eos(root: Path) -> list[int]:
    """``eos_token_id`` of a checkpoint's ``generation_config.json`` as a list (the chat stop
    tokens); empty when the file or the key is missing."""
    file = root / "generation_config.json"
    if not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    return list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
