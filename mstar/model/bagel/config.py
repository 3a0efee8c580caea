"""BAGEL's configuration, from the three files of its checkpoint: ``llm_config.json`` (the
Qwen2 language model), ``vit_config.json`` (the SigLIP tower) and ``config.json`` (how the
two are joined, and the generation side's latent settings).

The released inference code overrides parts of these files, and so do we, the same way:
the language model always has mixture-of-transformers layers with q/k norms and an untied
output head; the tower runs without 2D RoPE (its learned position table instead) and one
layer short of ``vit_config.json``'s count (BAGEL reads the penultimate layer's features).
``config.json`` keys that are absent take the values the inference code passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mstar.model.hf_config import config_kwargs, normalize_rope_scaling


@dataclass
class BagelLLMConfig:
    """The Qwen2 MoT decoder (``llm_config.json``; Hugging Face names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"unsupported hidden_act {self.hidden_act!r}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None:
            raise NotImplementedError(f"BAGEL runs plain RoPE; got rope_scaling {self.rope_scaling}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> BagelLLMConfig:
        return cls(**config_kwargs(cls, d, nullable=set()))


@dataclass
class BagelVisionConfig:
    """The SigLIP NaViT tower (``vit_config.json``; ``num_hidden_layers`` is the count BAGEL
    runs, one less than the file's)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        if self.hidden_act != "gelu_pytorch_tanh":
            raise NotImplementedError(f"unsupported vision hidden_act {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions(self) -> int:
        """Rows of the learned position table: a square grid of ``image_size / patch_size``."""
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> BagelVisionConfig:
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["num_hidden_layers"] = d["num_hidden_layers"] - 1
        return cls(**kwargs)


@dataclass
class BagelConfig:
    """The whole model: the two towers and how they are joined (``config.json``)."""

    llm: BagelLLMConfig
    vision: BagelVisionConfig
    vit_max_num_patch_per_side: int = 70  # the stride of a patch's flattened position, and the LLM-side 2D table
    connector_act: str = "gelu_pytorch_tanh"
    latent_patch_size: int = 2  # the generation side's (read by its modules)
    max_latent_size: int = 64
    interpolate_pos: bool = False
    timestep_shift: float = 1.0

    def __post_init__(self) -> None:
        if self.connector_act != "gelu_pytorch_tanh":
            raise NotImplementedError(f"unsupported connector_act {self.connector_act!r}")
        if self.interpolate_pos:
            raise NotImplementedError("interpolated ViT positions (interpolate_pos) are not supported")
        if self.vit_max_num_patch_per_side ** 2 > self.vision.num_positions:
            raise ValueError("vit_max_num_patch_per_side exceeds the tower's position table")

    @classmethod
    def from_dicts(cls, llm: dict[str, Any], vit: dict[str, Any], top: dict[str, Any] | None = None) -> BagelConfig:
        top = top or {}
        names = {f.name for f in fields(cls)} - {"llm", "vision"}
        return cls(BagelLLMConfig.from_hf_dict(llm), BagelVisionConfig.from_hf_dict(vit),
                   **{k: v for k, v in top.items() if k in names})

    @classmethod
    def from_dir(cls, root: Path) -> BagelConfig:
        """Read ``llm_config.json``, ``vit_config.json`` and (when present) ``config.json``."""
        def read(name: str) -> dict[str, Any]:
            return json.loads((root / name).read_text())

        top = read("config.json") if (root / "config.json").is_file() else {}
        return cls.from_dicts(read("llm_config.json"), read("vit_config.json"), top)
