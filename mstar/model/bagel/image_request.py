"""How an image request (``/v1/images/generations``, ``/v1/images/edits``, ``/generate``) becomes
a walk of BAGEL's generation side: the prompt's tokens, the seeded noise, the input image (an
edit) at the VAE's size and at the tower's, and the loop's params.

Defaults are those of BAGEL's own demo (``app.py``): 50 schedule points shifted by 3, text
guidance 4 from ``t > 0.4`` (generation) or throughout (editing), image guidance 1.5
(generation, where the image-dropped context is the full one) or 2 (editing), the ``global``
(generation) or ``text_channel`` (editing) renorm with its floor at 1 (so no rescale unless a
request lowers it). A request's ``model_kwargs`` may set each (``BagelImageOptions``);
``guidance_scale`` is the text scale and ``num_inference_steps`` the schedule's points.

An edit keeps the input image's size (after BAGEL's resize); the request's ``size`` is then
not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from mstar.contract import ImageSpec, RequestError
from mstar.model.bagel.generation import latent_grid
from mstar.model.bagel.vision import VAE_RESIZE, VAE_STRIDE, patch_positions, patchify, resized_size
from mstar.model.image_output import ImageOutputKnobs
from mstar.model.spec import WalkRequest

GENERATE, EDIT = "generate", "edit"


class BagelImageOptions(ImageOutputKnobs):
    """An image request's ``model_kwargs``: the encoding, and BAGEL's sampling options."""

    cfg_img_scale: float | None = Field(None, ge=0)
    """Image guidance (contexts with vs without the input image)."""

    cfg_interval: list[float] | None = None
    """Guidance applies where ``interval[0] < t <= interval[1]`` (t from 1, noise, to 0)."""

    cfg_renorm_type: Literal["global", "channel", "text_channel"] | None = None
    """How the guided velocity is rescaled towards the unguided one's norm."""

    cfg_renorm_min: float | None = Field(None, ge=0, le=1)
    """The rescale's floor (1: no rescale)."""

    timestep_shift: float | None = Field(None, gt=0)
    """The schedule's shift ``s t / (1 + (s - 1) t)``."""


@dataclass(frozen=True)
class SamplingDefaults:
    """One walk's defaults (``GENERATION_DEFAULTS``, ``EDIT_DEFAULTS``)."""

    cfg_text_scale: float
    cfg_img_scale: float
    cfg_interval: tuple[float, float]
    cfg_renorm_type: str
    cfg_renorm_min: float = 1.0
    timestep_shift: float = 3.0
    num_timesteps: int = 50


GENERATION_DEFAULTS = SamplingDefaults(4.0, 1.5, (0.4, 1.0), "global")
EDIT_DEFAULTS = SamplingDefaults(4.0, 2.0, (0.0, 1.0), "text_channel")
MAX_TIMESTEPS = 200


def sampling_params(spec: ImageSpec, options: BagelImageOptions, defaults: SamplingDefaults) -> dict:
    """The generator's params of a request (``mstar.model.bagel.image_engine``)."""
    steps = defaults.num_timesteps if spec.num_inference_steps is None else spec.num_inference_steps
    if not 2 <= steps <= MAX_TIMESTEPS:
        raise RequestError("num_inference_steps", f"must be between 2 and {MAX_TIMESTEPS}")
    text_scale = defaults.cfg_text_scale if spec.guidance_scale is None else spec.guidance_scale
    if text_scale < 0:
        raise RequestError("guidance_scale", "must be >= 0")
    interval = defaults.cfg_interval if options.cfg_interval is None else options.cfg_interval
    if len(interval) != 2 or not 0 <= interval[0] <= interval[1] <= 1:
        raise RequestError("cfg_interval", "must be [start, end] with 0 <= start <= end <= 1")

    def pick(value, default):
        return default if value is None else value

    return {"num_timesteps": steps, "num_steps": steps - 1, "cfg_text_scale": float(text_scale),
            "cfg_img_scale": float(pick(options.cfg_img_scale, defaults.cfg_img_scale)),
            "cfg_interval": tuple(interval),
            "cfg_renorm_type": pick(options.cfg_renorm_type, defaults.cfg_renorm_type),
            "cfg_renorm_min": float(pick(options.cfg_renorm_min, defaults.cfg_renorm_min)),
            "timestep_shift": float(pick(options.timestep_shift, defaults.timestep_shift)),
            **options.params}


def vae_pixels(image, vae_resize: tuple[int, int] = VAE_RESIZE) -> torch.Tensor:
    """A decoded PIL image as BAGEL's VAE reads it: RGB, resized (longest side at most
    ``vae_resize[0]``, shortest at least ``vae_resize[1]``, sides multiples of 16; bicubic),
    in ``[-1, 1]``: ``[3, H, W]`` float32."""
    import numpy as np
    from PIL import Image

    image = image.convert("RGB")
    size = resized_size(*image.size, *vae_resize, VAE_STRIDE)
    if size != image.size:
        image = image.resize(size, Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (pixels - 0.5) / 0.5


@dataclass(frozen=True)
class LatentShape:
    """What the noise's shape depends on: latent channels, patch side, pixels per token side,
    the position table's side."""

    channels: int = 16
    patch: int = 2
    downsample: int = 16
    max_latent_size: int = 64


def image_request(spec: ImageSpec, prompt_ids: list[int], shape: LatentShape, *, index: int = 0,
                  edit_image: torch.Tensor | None = None, vit_image: torch.Tensor | None = None,
                  vit_patch: int = 14, vit_max_side: int = 70, max_image_area: int | None = None) -> WalkRequest:
    """The ``generate`` walk's request (or ``edit``'s, given the input image at the VAE's size
    ``edit_image`` and at the tower's ``vit_image``, both ``[3, H, W]`` in ``[-1, 1]``)."""
    if not prompt_ids:
        raise RequestError("prompt", "must not be empty")
    options = BagelImageOptions.parse(spec.model_kwargs)
    if edit_image is None:
        height, width = spec.height, spec.width
        if height % shape.downsample or width % shape.downsample or not height or not width:
            raise RequestError("size", f"width and height must be positive multiples of {shape.downsample}")
    else:
        height, width = edit_image.shape[1:]
    h, w = latent_grid(height, width, shape.downsample)
    if max(h, w) > shape.max_latent_size:
        raise RequestError("size", f"{width}x{height}: a side over {shape.max_latent_size * shape.downsample} "
                                   "pixels is beyond the latent position table")
    if max_image_area is not None and width * height > max_image_area:
        raise RequestError("size", f"{width}x{height} is over max_image_area ({max_image_area} pixels)")
    params = sampling_params(spec, options, GENERATION_DEFAULTS if edit_image is None else EDIT_DEFAULTS)
    params.update(height=height, width=width)
    seed = (spec.seed if spec.seed is not None else torch.seed() % (1 << 31)) + index
    gen = torch.Generator().manual_seed(seed)
    inputs = {"prompt_ids": torch.tensor(prompt_ids, dtype=torch.long),
              "latents": torch.randn(h * w, shape.patch * shape.patch * shape.channels, generator=gen)}
    if edit_image is None:
        return WalkRequest(GENERATE, inputs, params)
    # BAGEL's VAE encodes an edit's image as a sample of its posterior: its noise, seeded too
    inputs["image"] = edit_image
    inputs["image_noise"] = torch.randn(shape.channels, h * shape.patch, w * shape.patch, generator=gen)
    if vit_image is not None:
        positions = patch_positions(vit_image.shape[1], vit_image.shape[2], vit_patch, vit_max_side)
        inputs.update(patches=patchify(vit_image, vit_patch), patch_positions=positions,
                      patch_counts=torch.tensor([len(positions)], dtype=torch.int64))
    return WalkRequest(EDIT, inputs, params)
