"""FLUX.2 [klein] editing: reference images as conditioning tokens.

An edit request carries up to four reference images. The frontend prepares each as the
FLUX.2 pipelines do (``prepare_reference``): an image over 1024x1024 pixels is scaled
(Lanczos, aspect kept) to that area, then centre-cropped to a multiple of the DiT's patch
in pixels (16 for the real VAE). The prepared images travel as one flat ``uint8`` tensor
``[3, sum(h * w)]`` with their sizes in the request parameters (``pack_pixels``), and the
VAE node's ``encode`` op turns them into normalised latent tokens (``encode_references``),
concatenated in order.

The DiT sees ``[image tokens; reference tokens]``. Reference ``i`` sits at time ``10 * (i + 1)``
on the first rotary axis, with its own row and column grid (``reference_ids``); the image
tokens sit at time 0. Only the image tokens' velocity is used: ``ReferenceDenoiseEngine``
appends the references before each step and keeps only the image rows of the result, so
the loop-carried state stays the image latents alone and the references are written once.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from mstar.contract import RequestError
from mstar.engine.base import EngineItem, EngineOutput
from mstar.engine.denoise import DenoiseEngine
from mstar.model.flux2.vae import Flux2VAE, pack_latents

MAX_REFERENCES = 4
MIN_REFERENCE_SIDE = 64  # the pipeline refuses smaller references
MAX_REFERENCE_ASPECT = 8  # ... and longer or thinner ones
MAX_REFERENCE_AREA = 1024 * 1024  # larger references are scaled down to this many pixels
TIME_STRIDE = 10  # reference i sits at time TIME_STRIDE * (i + 1); the image at time 0


def prepare_reference(image: Image.Image, multiple: int, field: str = "image") -> torch.Tensor:
    """An RGB reference image as the pipeline conditions on it: ``uint8 [3, h, w]`` with ``h``
    and ``w`` multiples of ``multiple``. Raises ``RequestError`` naming ``field`` for an
    image the model cannot use (a side under 64 pixels, an aspect ratio over 8:1)."""
    width, height = image.size
    if min(width, height) < MIN_REFERENCE_SIDE:
        raise RequestError(field, f"a reference image is {width}x{height}; each side must be at least "
                                  f"{MIN_REFERENCE_SIDE} pixels")
    if max(width, height) > MAX_REFERENCE_ASPECT * min(width, height):
        raise RequestError(field, f"a reference image is {width}x{height}; the aspect ratio must be at most "
                                  f"{MAX_REFERENCE_ASPECT}:1")
    if width * height > MAX_REFERENCE_AREA:
        scale = math.sqrt(MAX_REFERENCE_AREA / (width * height))
        image = image.resize((int(width * scale), int(height * scale)), Image.Resampling.LANCZOS)
        width, height = image.size
    crop_w, crop_h = width // multiple * multiple, height // multiple * multiple
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    image = image.crop((left, top, left + crop_w, top + crop_h)).convert("RGB")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


def pack_pixels(images: list[torch.Tensor]) -> tuple[torch.Tensor, list[list[int]]]:
    """Reference images ``uint8 [3, h, w]`` -> one tensor ``[3, sum(h * w)]`` and their sizes."""
    flat = torch.cat([image.reshape(3, -1) for image in images], dim=1)
    return flat, [[int(image.shape[1]), int(image.shape[2])] for image in images]


def unpack_pixels(flat: torch.Tensor, sizes: list[list[int]]) -> list[torch.Tensor]:
    """Inverse of ``pack_pixels``, each image as ``float32 [1, 3, h, w]`` in ``[-1, 1]`` (the
    pipeline's ``x / 255`` then ``2x - 1``)."""
    images, start = [], 0
    for h, w in sizes:
        pixels = flat[:, start:start + h * w].reshape(1, 3, h, w)
        images.append(pixels.float() / 255 * 2 - 1)
        start += h * w
    if start != flat.shape[1]:
        raise ValueError(f"reference pixels hold {flat.shape[1]} columns, the sizes {sizes} need {start}")
    return images


def encode_references(vae: Flux2VAE, flat: torch.Tensor, sizes: list[list[int]]) -> torch.Tensor:
    """VAE tokens ``[sum(rows * cols), 4C]`` of the references, in order: the posterior mean,
    patchified and normalised by the VAE's batch-norm statistics."""
    param = next(vae.parameters())
    mean, std = vae.latent_norm()
    tokens = [pack_latents(vae.encode(image.to(param.device, param.dtype)), mean, std)[0]
              for image in unpack_pixels(flat, sizes)]
    return torch.cat(tokens)


def reference_grids(sizes: list[list[int]], scale_factor: int) -> list[list[int]]:
    """Token grid ``[rows, cols]`` of each reference of pixel size ``[h, w]``."""
    patch = 2 * scale_factor
    return [[h // patch, w // patch] for h, w in sizes]


def reference_ids(grids: list[list[int]]) -> torch.Tensor:
    """Positions ``(t, h, w, l)`` of the reference tokens ``[sum(rows * cols), 4]``: reference
    ``i`` at time ``10 * (i + 1)``, its grid row-major."""
    ids = []
    for i, (rows, cols) in enumerate(grids):
        block = torch.zeros(rows * cols, 4, dtype=torch.int64)
        block[:, 0] = TIME_STRIDE * (i + 1)
        block[:, 1] = torch.arange(rows).repeat_interleave(cols)
        block[:, 2] = torch.arange(cols).repeat(rows)
        ids.append(block)
    return torch.cat(ids) if ids else torch.zeros(0, 4, dtype=torch.int64)


class ReferenceDenoiseEngine(DenoiseEngine):
    """The denoise engine for walks that condition on reference tokens: an item that reads
    ``references`` runs the DiT on its latents with the references appended (the velocity
    function sees them and places them by the request's ``reference_grids``), and its
    ``latents`` / ``velocity`` outputs keep only the image rows. Other items run as usual."""

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        outputs = super().run([_with_references(item) for item in items])
        for item, output in zip(items, outputs):
            if "references" in item.inputs:
                rows = item.inputs["latents"].shape[0]
                for port in ("latents", "velocity"):
                    if port in output.outputs:
                        output.outputs[port] = output.outputs[port][:rows].clone()
        return outputs


def _with_references(item: EngineItem) -> EngineItem:
    inputs = dict(item.inputs)
    references = inputs.pop("references", None)
    if references is None:
        return item
    latents = inputs["latents"]
    inputs["latents"] = torch.cat([latents, references.to(latents.device, latents.dtype)])
    return replace(item, inputs=inputs)
