"""Configuration of the FLUX.2 diffusion transformer (DiT).

Field names and defaults mirror the constructor of diffusers' ``Flux2Transformer2DModel``
(diffusers 0.42.1), i.e. the keys of a checkpoint's ``transformer/config.json``; the defaults
describe FLUX.2 [dev]. ``PRESETS`` holds the FLUX.2 [klein] 4B and 9B variants.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mstar.model.hf_config import DiffusersConfig


@dataclass
class Flux2TransformerConfig(DiffusersConfig):
    """Hyper-parameters of a FLUX.2 transformer; names follow the diffusers ``config.json``."""

    diffusers_class = "Flux2Transformer2DModel"

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None  # None: same as in_channels
    num_layers: int = 8  # double-stream (separate image / text weights) blocks
    num_single_layers: int = 48  # single-stream (fused attention + MLP) blocks
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360  # width of the text-encoder features
    timestep_guidance_channels: int = 256  # sinusoidal features per timestep / guidance value
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = field(default_factory=lambda: (32, 32, 32, 32))
    rope_theta: int = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True  # guidance-distilled checkpoints embed the guidance scale

    def __post_init__(self) -> None:
        self.axes_dims_rope = tuple(int(d) for d in self.axes_dims_rope)
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"every rope axis needs an even width, got {self.axes_dims_rope}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                f"{self.attention_head_dim}"
            )

    @property
    def inner_dim(self) -> int:
        """Width of the residual stream (heads * head dim)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def resolved_out_channels(self) -> int:
        """Channels per output token before patch unpacking."""
        return self.out_channels or self.in_channels

    @classmethod
    def preset(cls, name: str) -> Flux2TransformerConfig:
        """A fresh copy of a named preset (see ``PRESETS``)."""
        try:
            return replace(PRESETS[name])
        except KeyError:
            raise KeyError(f"unknown FLUX.2 preset {name!r}; known: {sorted(PRESETS)}") from None


# FLUX.2 [klein] presets. diffusers 0.42.1 itself ships no klein config: its pipeline only shows
# that klein conditions on three stacked Qwen3 hidden layers (``hidden_states_layers=(9, 18, 27)``),
# so joint_attention_dim = 3 * Qwen3 hidden size (Qwen3-4B: 2560, Qwen3-8B: 4096), and that the
# distilled / base pipelines call the transformer with ``guidance=None``. Depth and width come from
# third-party ports that load the official checkpoints (mflux ``ModelConfig`` transformer
# overrides, flux-2-swift-mlx ``Flux2Config``, and a copy of the 9B ``transformer/config.json``
# embedded in a public loader) which agree with each other. The 4B/9B base (undistilled)
# checkpoints share these shapes. Verify against the checkpoint's own config.json when loading.
PRESETS: dict[str, Flux2TransformerConfig] = {
    "flux2-klein-4b": Flux2TransformerConfig(
        num_layers=5,
        num_single_layers=20,
        num_attention_heads=24,  # inner dim 3072
        joint_attention_dim=7680,  # 3 x 2560 (Qwen3-4B)
        guidance_embeds=False,
    ),
    "flux2-klein-9b": Flux2TransformerConfig(
        num_layers=8,
        num_single_layers=24,
        num_attention_heads=32,  # inner dim 4096
        joint_attention_dim=12288,  # 3 x 4096 (Qwen3-8B)
        guidance_embeds=False,
    ),
}
