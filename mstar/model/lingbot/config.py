"""Configuration of LingBot-World's causal DiT (v2, 1.3B causal-fast).

The DiT is Wan2.1-T2V-1.3B's layout (``WanTransformerConfig``: 12 heads of 128, FFN 8960, 30
blocks) fed 36 channels a latent cell: the 16 noisy latent channels, then the image condition
(4 mask channels and the 16 latent channels of the first frame, zeros after it). What LingBot
adds: Plücker rays of the camera trajectory (6 numbers a pixel, 8 x 8 pixels a latent cell, so
384 channels a cell) injected in every block, and a causal rollout over chunks of
``chunk_frames`` latent frames with a rolling KV cache (``window_frames``, ``sink_frames``), each
chunk denoised in the distilled few steps (``timestep_indices`` into the 1000-step shifted flow
schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.model.wan22.config import WanTransformerConfig

RAY_CHANNELS = 6  # a Plücker ray: origin (3) and direction (3)


def wan21_1_3b() -> WanTransformerConfig:
    """Wan2.1-1.3B's DiT with LingBot's 36 input channels (noise, mask, image latents)."""
    return WanTransformerConfig(num_attention_heads=12, attention_head_dim=128, in_channels=36, out_channels=16,
                                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30)


@dataclass
class LingbotConfig:
    dit: WanTransformerConfig = field(default_factory=wan21_1_3b)
    vae_stride: tuple[int, int, int] = (4, 8, 8)  # (time, rows, columns) pixels a latent cell
    chunk_frames: int = 3  # latent frames denoised together
    window_frames: int | None = None  # latent frames a chunk attends to (itself included); None: all
    sink_frames: int = 0  # the first frames, kept in the window whatever its size
    timestep_indices: tuple[int, ...] = (0, 250, 500, 750)  # the distilled steps in the 1000-step schedule
    shift: float = 5.0  # the flow schedule's shift
    num_train_timesteps: int = 1000
    text_len: int = 512  # prompt features, zero-padded

    def __post_init__(self) -> None:
        if self.chunk_frames < 1:
            raise ValueError(f"chunk_frames must be at least 1, got {self.chunk_frames}")
        if self.window_frames is not None and self.window_frames < self.chunk_frames + self.sink_frames:
            raise ValueError(f"window_frames {self.window_frames} must hold a chunk ({self.chunk_frames}) "
                             f"and the sink ({self.sink_frames})")
        if not self.timestep_indices or any(not 0 <= i < self.num_train_timesteps for i in self.timestep_indices):
            raise ValueError(f"timestep_indices {self.timestep_indices} must lie in [0, {self.num_train_timesteps})")
        latent = self.dit.out_channels
        if self.dit.in_channels != 2 * latent + self.vae_stride[0]:
            raise ValueError(f"the DiT takes {self.dit.in_channels} channels; LingBot's i2v input is "
                             f"{2 * latent + self.vae_stride[0]} (latents, {self.vae_stride[0]} mask, image latents)")

    @property
    def camera_channels(self) -> int:
        """Plücker numbers a latent cell: 6 for each of its pixels."""
        return RAY_CHANNELS * self.vae_stride[1] * self.vae_stride[2]
