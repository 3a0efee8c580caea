"""Cosmos3's deployment knobs: the pipeline's sampling defaults (35 UniPC steps, guidance 6),
the batch cap of the denoise step, the VAE's dtype and the size caps checked before a request
is queued."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.model.diffusion_knobs import MAX_STEPS
from mstar.model.knobs import Knobs


class Cosmos3Knobs(Knobs):
    num_inference_steps: int = Field(35, ge=1, le=MAX_STEPS)
    """The step count of requests that send none (the pipeline's 35)."""

    guidance_scale: float = Field(6.0, ge=1.0)
    """Classifier-free guidance of requests that send none (the pipeline's 6; 1: off)."""

    max_gen_batch_size: int = Field(8, ge=1)
    """Tower rows per denoise forward (a guided request is two rows), across requests at the
    same walk step whatever their sizes."""

    vae_dtype: Literal["float32", "bfloat16"] = "float32"
    """The VAE's dtype, whatever the deployment's."""

    vae_decode_chunk: int = Field(1, ge=1)
    """Latent frames the VAE decodes together after the first (1, as diffusers)."""

    max_image_area: int = Field(1280 * 1280, ge=1)
    """The largest ``width * height`` a request may ask for."""

    conditioning_resize: Literal["cover", "stretch"] = "cover"
    """How an i2v request's image becomes the first frame: ``cover`` (scale to cover the output
    size keeping the aspect ratio, center-crop; diffusers 0.40 and later) or ``stretch``
    (resize to the output size). A request may override it."""

    max_video_pixels: int = Field(1280 * 720 * 189, ge=1)
    """The largest ``width * height * num_frames`` a request may ask for (the pipeline's default
    clip, 1280x720x189)."""

    enable_windowed_video: bool = False
    """Declare the windowed walks (``window_mode`` chained or kv, ``stream_video``, sessions;
    ``mstar.model.cosmos3.windowed``): a long clip made window by window. kv is experimental:
    the frontend logs a warning at startup."""

    max_windows: int = Field(64, ge=1)
    """The most windows one windowed request may take."""

    reasoner_max_images: int = Field(8, ge=0)
    """Image parts per reasoner chat (``cosmos3_edge``); more is a 400 naming the part."""

    reasoner_max_videos: int = Field(1, ge=0)
    """Video parts per reasoner chat."""

    reasoner_max_image_pixels: int = Field(4096 * 4096, ge=1)
    """The largest image or video frame (``width * height``, before resizing) a reasoner chat may
    bring (the image processor's largest area)."""

    reasoner_video_fps: float = Field(2.0, gt=0)
    """The rate a chat's video is sampled at (the reference's 2 frames a second)."""

    reasoner_max_frames: int = Field(768, ge=1)
    """Frames sampled from one video at most (the reference video processor's 768)."""

    reasoner_attention_backend: Literal["torch", "triton"] = "torch"
    """The reasoner's paged-attention kernels: ``torch`` (the reference) or ``triton``."""

    domain_name: str | None = None
    """The embodiment of action requests that name none (the policies: ``droid_lerobot``)."""

    action_chunk_size: int = Field(32, ge=1)
    """Actions per chunk of action requests that send none (the observation clip is
    ``action_chunk_size + 1`` frames)."""

    max_action_chunk_size: int = Field(128, ge=1)
    """The longest chunk a request may ask for."""
