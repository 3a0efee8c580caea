"""Configuration of the Wan video DiT.

Field names and defaults follow the constructor of diffusers' ``WanTransformer3DModel``
(diffusers 0.42.1), i.e. the keys of a checkpoint's ``transformer/config.json``; the defaults
describe Wan2.2-TI2V-5B (the one variant served: a dense DiT over 48-channel latents, no image
cross-attention).
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.model.hf_config import DiffusersConfig


@dataclass
class WanTransformerConfig(DiffusersConfig):
    """Hyper-parameters of a Wan DiT; names follow the diffusers ``config.json``."""

    diffusers_class = "WanTransformer3DModel"

    patch_size: tuple[int, int, int] = (1, 2, 2)  # (frames, rows, columns) of latent cells per token
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    in_channels: int = 48
    out_channels: int = 48
    text_dim: int = 4096  # UMT5-XXL hidden size
    freq_dim: int = 256  # sinusoidal timestep features
    ffn_dim: int = 14336
    num_layers: int = 30
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None  # Wan2.1 I2V's CLIP image branch: not supported
    added_kv_proj_dim: int | None = None  # ditto
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None  # ditto

    def __post_init__(self) -> None:
        self.patch_size = tuple(int(p) for p in self.patch_size)  # type: ignore[assignment]
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size needs (frames, rows, columns), got {self.patch_size}")
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if getattr(self, key) is not None:
                raise ValueError(f"{key} is set: Wan's CLIP image branch (Wan2.1 I2V) is not supported")
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(f"qk_norm {self.qk_norm!r} is not supported (only 'rms_norm_across_heads')")
        if self.attention_head_dim % 2:
            raise ValueError(f"attention_head_dim {self.attention_head_dim} must be even")

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Rotary widths of the (frame, row, column) axes: rows and columns a third each, rounded
        down to an even width, frames the rest."""
        hw = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * hw, hw, hw
