"""Configuration of the Nemotron-H hybrid language model (Mamba-2 + attention + MLP layers)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
# hybrid_override_pattern's letters, and the older layer-type names, as transformers reads them
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY_TYPES = {"mamba": MAMBA, "attention": ATTENTION}
# Older config.json names of the Mamba fields
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
           "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}


@dataclass
class NemotronHConfig:
    """The model's hyper-parameters; names follow transformers' ``NemotronHConfig``.

    ``layer_types`` has one entry per layer: ``linear_attention`` (a Mamba-2 mixer),
    ``full_attention`` (attention without positional encoding) or ``mlp``; a checkpoint may
    give them as ``layers_block_type`` or as ``hybrid_override_pattern`` (``M``, ``*``, ``-``).
    Every layer is one pre-norm residual block around its mixer.
    """

    vocab_size: int
    hidden_size: int
    layer_types: list[str]
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    mamba_hidden_act: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = 2
    mamba_ssm_cache_dtype: str = "float32"
    attention_layers: list[int] = field(init=False)
    mamba_layers: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.layer_types = [LEGACY_TYPES.get(t, t) for t in self.layer_types]
        unknown = sorted(set(self.layer_types) - {MAMBA, ATTENTION, MLP})
        if unknown:
            raise NotImplementedError(f"unsupported Nemotron-H layer types {unknown} (mixture-of-experts layers "
                                      f"are not implemented)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of n_groups "
                             f"({self.n_groups})")
        if self.mlp_hidden_act != "relu2" or self.mamba_hidden_act != "silu":
            raise NotImplementedError(f"unsupported activations mlp_hidden_act={self.mlp_hidden_act!r}, "
                                      f"mamba_hidden_act={self.mamba_hidden_act!r}")
        self.time_step_limit = (float(self.time_step_limit[0]), float(self.time_step_limit[1]))
        self.attention_layers = [i for i, t in enumerate(self.layer_types) if t == ATTENTION]
        self.mamba_layers = [i for i, t in enumerate(self.layer_types) if t == MAMBA]

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> NemotronHConfig:
        d = {ALIASES.get(k, k): v for k, v in d.items()}
        if "layer_norm_epsilon" not in d and "rms_norm_eps" in d:  # the name some exports use
            d["layer_norm_epsilon"] = d["rms_norm_eps"]
        layer_types = d.get("layers_block_type") or d.get("layer_types")
        if not layer_types:
            pattern = d.get("hybrid_override_pattern")
            if not pattern:
                raise ValueError("config.json names no layer types (layers_block_type or hybrid_override_pattern)")
            try:
                layer_types = [PATTERN[c] for c in pattern]
            except KeyError as err:
                raise ValueError(f"hybrid_override_pattern {pattern!r}: unknown layer letter {err}") from None
        names = {f.name for f in fields(cls) if f.init} - {"layer_types"}
        kwargs = {k: d[k] for k in names if k in d and d[k] is not None}
        return cls(layer_types=list(layer_types), **kwargs)
