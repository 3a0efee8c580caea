"""Configuration of the LTX-2.x joint audio-video DiT.

Field names and defaults follow the constructor of diffusers' ``LTX2VideoTransformer3DModel``
(diffusers 0.42.1), i.e. the keys of a checkpoint's ``transformer/config.json``. The switches
cover the LTX-2.0, 2.3 and 2.5 variants of the block (gated attention, prompt-side modulation,
split or interleaved rotary channels, bias-free feed-forwards); what the served recipes never
use (spatio-temporal guidance) is accepted in the config and simply not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.model.hf_config import DiffusersConfig


@dataclass
class LtxTransformerConfig(DiffusersConfig):
    """Hyper-parameters of an LTX-2.x DiT; names follow the diffusers ``config.json``."""

    diffusers_class = "LTX2VideoTransformer3DModel"

    # video stream
    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)  # pixel (frames, rows, columns) per latent cell
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False  # per-head sigmoid gates on every video attention
    cross_attn_mod: bool = False  # prompt cross-attention query modulated by the time (9 mod vectors)
    # audio stream
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4  # mel frames per audio latent frame
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    # shared
    num_layers: int = 48
    activation_fn: str = "gelu-approximate"
    qk_norm: str = "rms_norm_across_heads"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"  # "interleaved" (LTX-2.0) or "split" (2.3 and later)
    use_prompt_embeddings: bool = True  # the DiT projects the prompt itself (2.0); later ones in the connectors
    perturbed_attn: bool = False  # spatio-temporal guidance: not offered, same maths without it
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True  # the prompt's K/V modulation follows the time (2.3), else a fixed table
    use_keyframes_abs_pos_embedding: bool = False

    def __post_init__(self) -> None:
        self.vae_scale_factors = tuple(int(s) for s in self.vae_scale_factors)  # type: ignore[assignment]
        if len(self.vae_scale_factors) != 3:
            raise ValueError(f"vae_scale_factors needs (frames, rows, columns), got {self.vae_scale_factors}")
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(f"qk_norm {self.qk_norm!r} is not supported (only 'rms_norm_across_heads')")
        if self.activation_fn != "gelu-approximate":
            raise ValueError(f"activation_fn {self.activation_fn!r} is not supported (only 'gelu-approximate')")
        if self.rope_type not in ("interleaved", "split"):
            raise ValueError(f"rope_type {self.rope_type!r} must be 'interleaved' or 'split'")
        if self.audio_cross_attention_dim != self.audio_dim:
            raise ValueError(f"audio_cross_attention_dim {self.audio_cross_attention_dim} must equal the audio "
                             f"width {self.audio_dim}: the audio-video attentions rotate that many channels")
        self.out_channels = self.out_channels or self.in_channels
        self.audio_out_channels = self.audio_out_channels or self.audio_in_channels

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_dim(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def prompt_modulation(self) -> bool:
        """Whether the blocks modulate the prompt cross-attention (LTX-2.3 and later)."""
        return self.cross_attn_mod or self.audio_cross_attn_mod
