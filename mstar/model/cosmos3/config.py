"""Configuration of the Cosmos3 tower, read from a checkpoint's ``transformer/config.json``.

Field names and defaults follow the constructor of diffusers' ``Cosmos3OmniTransformer``
(diffusers 0.42.1). The variants differ only here:

- Nano (``cosmos3``, ``cosmos3_droid``): a Qwen3-style backbone, ``hidden_act: silu`` (gated
  SiLU MLPs), RMS norms that scale in the input dtype, per-head q/k norms on both pathways.
- Edge (``cosmos3_edge``, ``cosmos3_edge_droid``): a dense Nemotron backbone,
  ``hidden_act: relu2`` (ungated squared-ReLU MLPs, no ``gate_proj``), Nemotron RMS norms
  (scale applied in float32), usually ``qk_norm_for_text: false`` with
  ``use_und_k_norm_for_gen: true`` (a separate k norm on the text keys the video tokens read).
- Super (``cosmos3_super`` and its 4-step distillations): Nano's layout, wider and deeper.

The DROID policies set ``action_gen`` (and ``action_dim``); Nano and Super set ``sound_gen``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.model.hf_config import DiffusersConfig


@dataclass
class Cosmos3Config(DiffusersConfig):
    """Hyper-parameters of the Cosmos3 tower; names follow the diffusers ``config.json``."""

    diffusers_class = "Cosmos3OmniTransformer"

    attention_bias: bool = False
    attention_dropout: float = 0.0
    head_dim: int = 128
    hidden_size: int = 4096
    intermediate_size: int = 12288
    base_fps: int = 24
    enable_fps_modulation: bool = True  # temporal rotary positions scaled by the clip's fps
    latent_channel: int = 48  # the Wan2.2 VAE's latent channels
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000  # rotary gap between text and media
    latent_patch_size: int = 2
    num_attention_heads: int = 32
    num_hidden_layers: int = 36
    num_key_value_heads: int = 8
    patch_latent_dim: int = 192  # latent_channel * latent_patch_size ** 2
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    rope_theta: float = 5000000.0
    action_dim: int | None = None
    action_gen: bool = False
    num_embodiment_domains: int = 32
    sound_dim: int | None = None
    sound_gen: bool = False
    sound_latent_fps: float = 25.0
    timestep_scale: float = 0.001  # the sampler's timesteps (0..1000) -> the time embedding's input
    vocab_size: int = 151936
    hidden_act: str = "silu"
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False
    rope_axes_dim: tuple[int, int, int] | None = None  # mRoPE section (frequencies per axis)
    dtype: str = "bfloat16"  # a load-time hint in the released configs; not read

    def __post_init__(self) -> None:
        if self.hidden_act not in ("silu", "relu2"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Cosmos3 uses 'silu' or 'relu2')")
        if self.rope_axes_dim is None:
            section = (self.rope_scaling or {}).get("mrope_section", [24, 20, 20])
            self.rope_axes_dim = tuple(int(s) for s in section)
        self.rope_axes_dim = tuple(int(s) for s in self.rope_axes_dim)  # type: ignore[assignment]
        if len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) * 2 != self.head_dim:
            raise ValueError(f"rope_axes_dim {list(self.rope_axes_dim)} must be three widths summing to "
                             f"head_dim / 2 = {self.head_dim // 2}")
        if self.patch_latent_dim != self.latent_channel * self.latent_patch_size ** 2:
            raise ValueError(f"patch_latent_dim {self.patch_latent_dim} != latent_channel x latent_patch_size^2 "
                             f"({self.latent_channel} x {self.latent_patch_size}^2)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.action_gen and self.action_dim is None:
            raise ValueError("action_gen is set but action_dim is not")
        if self.sound_gen and self.sound_dim is None:
            raise ValueError("sound_gen is set but sound_dim is not")

    @property
    def nemotron(self) -> bool:
        """Edge's Nemotron backbone: squared-ReLU MLPs and norms that scale in float32."""
        return self.hidden_act == "relu2"
