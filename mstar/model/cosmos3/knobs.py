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

    domain_name: str | None = None
    """The embodiment of action requests that name none (the policies: ``droid_lerobot``)."""

    action_chunk_size: int = Field(32, ge=1)
    """Actions per chunk of action requests that send none (the observation clip is
    ``action_chunk_size + 1`` frames)."""

    max_action_chunk_size: int = Field(128, ge=1)
    """The longest chunk a request may ask for."""
