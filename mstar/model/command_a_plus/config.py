"""Configuration of Command A+ (Cohere2-MoE): the text decoder's dimensions, read from the
checkpoint's ``config.json`` (``text_config`` of the vision-language release)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.model.hf_config import config_kwargs, normalize_rope_scaling


@dataclass
class CommandAPlusConfig:
    """The hyper-parameters of a Cohere2-MoE decoder; names follow Hugging Face ``config.json``.

    Each layer is ``x + attention(norm(x)) + mlp(norm(x))`` (one norm, attention and MLP side
    by side). ``layer_types`` says which layers attend within a ``sliding_window`` (with RoPE)
    and which attend to everything (no position embedding at all); ``mlp_layer_types`` which
    MLPs are dense (a prefix of ``first_k_dense_replace`` layers) and which sparse (routed
    experts plus ``num_shared_experts`` always-on ones). Without ``rms_norm_eps`` the norms are
    bias-free LayerNorms (``layer_norm_eps``). Logits are scaled by ``logit_scale``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    logit_scale: float = 0.0625
    layer_norm_eps: float = 1e-5
    rms_norm_eps: float | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 4
    prefix_dense_sliding_window_pattern: int = 1
    first_k_dense_replace: int = 0
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 0
    shared_expert_combination_strategy: str = "average"
    expert_selection_fn: str = "softmax"
    norm_topk_prob: bool = True
    prefix_dense_intermediate_size: int | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"
    bos_token_id: int | None = 5
    eos_token_id: int | list[int] | None = 255001
    pad_token_id: int | None = 0

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"unsupported hidden_act {self.hidden_act!r}")
        if self.expert_selection_fn not in ("softmax", "sigmoid"):
            raise ValueError(f"expert_selection_fn {self.expert_selection_fn!r}: 'softmax' or 'sigmoid'")
        if self.shared_expert_combination_strategy not in ("average", "sum"):
            raise ValueError(f"shared_expert_combination_strategy {self.shared_expert_combination_strategy!r}: "
                             "'average' or 'sum'")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None:
            raise NotImplementedError(f"rope_scaling {self.rope_scaling['rope_type']!r}")
        dense = self.first_k_dense_replace
        if self.layer_types is None:  # as transformers derives it
            prefix = ["full_attention" if (i + 1) % self.prefix_dense_sliding_window_pattern == 0
                      else "sliding_attention" for i in range(dense)]
            rest = ["full_attention" if (i + 1) % self.sliding_window_pattern == 0 else "sliding_attention"
                    for i in range(self.num_hidden_layers - dense)]
            self.layer_types = prefix + rest
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < dense else "sparse" for i in range(self.num_hidden_layers)]
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != self.num_hidden_layers:
                raise ValueError(f"{name} names {len(getattr(self, name))} layers, the model has "
                                 f"{self.num_hidden_layers}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention (None: it attends to every position)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def rotary(self, layer: int) -> bool:
        """Whether ``layer`` rotates its queries and keys: the sliding-window layers, and the
        dense prefix when it has no pattern of its own (transformers' ``force_rope``)."""
        return self.window(layer) is not None or (
            self.mlp_layer_types[layer] == "dense" and self.prefix_dense_sliding_window_pattern == 1)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> CommandAPlusConfig:
        """From a Hugging Face ``config.json`` dict: a ``Cohere2MoeConfig``'s, or a
        ``Cohere2VisionConfig``'s (its ``text_config``). Unknown keys are ignored."""
        if "text_config" in d:
            d = d["text_config"]
        return cls(**config_kwargs(cls, d, nullable={"bos_token_id", "eos_token_id", "pad_token_id",
                                                     "rms_norm_eps", "sliding_window"}))


@dataclass
class CommandVisionConfig:
    """The image side of the vision-language release: a SigLIP tower (``vision_config``) over
    ``image_size`` tiles, and the projector that folds each ``downsample_factor`` squared
    patches into one text token (``alignment_intermediate_size``: its SwiGLU's width, both
    halves). ``image_token_id``: the placeholder the image's tokens replace."""

    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 27
    num_attention_heads: int = 12
    image_size: int = 512
    patch_size: int = 16
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    downsample_factor: int = 2
    alignment_intermediate_size: int = 36864
    image_token_id: int = 255036

    def __post_init__(self) -> None:
        if self.hidden_act != "gelu_pytorch_tanh":
            raise NotImplementedError(f"vision hidden_act {self.hidden_act!r}")
        if (self.image_size // self.patch_size) % self.downsample_factor:
            raise ValueError("the patch grid does not divide by downsample_factor")

    @property
    def tokens_per_tile(self) -> int:
        """Text tokens of one tile: its patch grid, downsampled."""
        return (self.image_size // self.patch_size // self.downsample_factor) ** 2

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> CommandVisionConfig | None:
        """From a ``Cohere2VisionConfig`` dict (None for a text-only ``config.json``)."""
        if "vision_config" not in d:
            return None
        vision = d["vision_config"] or {}
        names = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in vision.items() if k in names}
        kwargs |= {k: d[k] for k in ("downsample_factor", "alignment_intermediate_size", "image_token_id") if k in d}
        return cls(**kwargs)
