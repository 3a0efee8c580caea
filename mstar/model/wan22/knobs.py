"""Wan2.2's deployment knobs: the diffusion families' (``DiffusionKnobs``), 50 steps and guidance
5 by default (the model card's), the VAE's dtype (float32 by default, as the card loads it), and
the video caps checked before a request is queued."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.model.diffusion_knobs import DiffusionKnobs, Steps
from mstar.model.knobs import FusedKernels


class WanKnobs(DiffusionKnobs, FusedKernels):
    """``fused_kernels``: the VAE's channel RMS norms and their SiLU as one Triton kernel each
    (``mstar.layers.triton_channel_norm``), three passes over an activation instead of about ten;
    on CUDA, the DiT's feed-forward GELU as its first product's cuBLASLt epilogue."""

    num_inference_steps: Steps = 50

    guidance_scale: float = Field(5.0, ge=1.0)
    """Classifier-free guidance of requests that send none (1: off)."""

    cfg_parallel: bool = False
    """Guidance as two ``Parallel`` branches (``dit`` and ``dit_uncond``, placed by the YAML on one
    rank or two) instead of a batched pair."""

    vae_dtype: Literal["float32", "bfloat16"] = "float32"
    """The VAE's dtype, whatever the deployment's: float32 as in the model card's recipe."""

    vae_decode_chunk: int = Field(1, ge=1)
    """Latent frames the VAE decodes together after the first (1, as diffusers). The same video;
    larger chunks make fewer, larger convolutions and hold several times the activations."""

    vae_channels_last: bool = True
    """On CUDA, the VAE's convolution weights and so its activations channels-last (cuDNN's own
    layout: no NCHW <-> NHWC conversion around each convolution, and faster kernels; S8's decode
    on an H100 took 0.80 s against 1.00 s). The same frames to a uint8 level (TF32 rounding).
    Ignored off CUDA."""

    max_video_pixels: int = Field(1 << 28, ge=1)
    """The largest ``width * height * num_frames`` a request may ask for (2^28: about 3.6x the
    default 1280x704x81 clip)."""
