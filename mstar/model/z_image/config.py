"""Configuration of the Z-Image diffusion transformer.

Field names and defaults follow the constructor of diffusers' ``ZImageTransformer2DModel``
(diffusers 0.42.1), i.e. the keys of a checkpoint's ``transformer/config.json``; the defaults
describe Z-Image(-Turbo), 6B parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.model.hf_config import DiffusersConfig

ADALN_DIM = 256  # width of the timestep embedding that drives every adaLN modulation (capped by dim)
SEQ_MULTIPLE = 32  # image and caption token runs are padded to a multiple of this


@dataclass
class ZImageTransformerConfig(DiffusersConfig):
    """Hyper-parameters of a Z-Image DiT; names follow the diffusers ``config.json``."""

    diffusers_class = "ZImageTransformer2DModel"

    all_patch_size: tuple[int, ...] = (2,)  # spatial patch side, one entry per patch embedder
    all_f_patch_size: tuple[int, ...] = (1,)  # frame patch size, paired with all_patch_size
    in_channels: int = 16  # VAE latent channels (output channels are the same)
    dim: int = 3840
    n_layers: int = 30  # main single-stream blocks over [image, caption]
    n_refiner_layers: int = 2  # blocks over the image alone (modulated) and the caption alone
    n_heads: int = 30
    n_kv_heads: int = 30  # kept for the config; diffusers' attention uses n_heads for k and v
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560  # width of the caption features (Qwen3-4B hidden size)
    siglip_feat_dim: int | None = None  # the Omni variant's image conditioning: not supported
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)  # rotary widths of the (frame, row, column) axes
    axes_lens: tuple[int, ...] = (1024, 512, 512)  # position range of each rotary axis

    def __post_init__(self) -> None:
        self.all_patch_size = tuple(int(p) for p in self.all_patch_size)
        self.all_f_patch_size = tuple(int(p) for p in self.all_f_patch_size)
        self.axes_dims = tuple(int(d) for d in self.axes_dims)
        self.axes_lens = tuple(int(n) for n in self.axes_lens)
        if len(self.all_patch_size) != len(self.all_f_patch_size):
            raise ValueError("all_patch_size and all_f_patch_size must have the same length")
        if self.siglip_feat_dim is not None:
            raise ValueError("siglip_feat_dim is set: the Z-Image Omni variant is not supported")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if len(self.axes_dims) != 3 or len(self.axes_lens) != 3:
            raise ValueError("axes_dims and axes_lens need one entry per axis (frame, row, column)")
        if any(d % 2 for d in self.axes_dims) or sum(self.axes_dims) != self.head_dim:
            raise ValueError(f"axes_dims {self.axes_dims} must be even and sum to the head dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_DIM)

    @property
    def ffn_dim(self) -> int:
        return int(self.dim / 3 * 8)
