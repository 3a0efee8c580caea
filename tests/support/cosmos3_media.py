"""Conditioning media for the Cosmos3 tests: smooth random images (so resizes and the VAE see
structure, not just noise) and their PNG bytes."""

from __future__ import annotations

import io

import torch
from PIL import Image


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB image: a 4x4 field upsampled, with a little fine noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 4, 4, generator=g)
    fine = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    fine = fine + 0.15 * torch.rand(1, 3, height, width, generator=g)
    return Image.fromarray((fine.clamp(0, 1) * 255).round().byte()[0].permute(1, 2, 0).numpy())


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
