"""Conditioning media for the Cosmos3 tests: smooth random images (so resizes and the VAE see
structure, not just noise) and their PNG bytes."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from PIL import Image

from mstar.contract import GenerateSpec


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


def generate_action(d, request_id: str, prompt: str, files, modalities, **kwargs) -> dict[str, bytes]:
    """One request to an action deployment ``d`` (in process, the 256 resolution tier), its
    outputs' bytes joined per modality."""
    async def go():
        out: dict[str, bytes] = {}
        spec = GenerateSpec(request_id, prompt, files, modalities, {"resolution_tier": 256, **kwargs})
        async for event in d.backend.generate(spec):
            assert not event.error, event.error
            if event.data:
                out[event.modality] = out.get(event.modality, b"") + event.data
        return out

    return asyncio.run(go())


@contextmanager
def step_latents(d) -> Iterator[list[torch.Tensor]]:
    """The latents deployment ``d``'s denoise engine (node ``dit``) writes, every step of every
    request in order, collected while the block runs."""
    dit = d.runtime.workers.workers[0].engines["dit"]
    seen: list[torch.Tensor] = []
    original = dit.run

    def record(items):
        outputs = original(items)
        seen.extend(o.outputs["latents"].clone() for o in outputs if "latents" in o.outputs)
        return outputs

    dit.run = record
    try:
        yield seen
    finally:
        del dit.run
