"""Z-Image-Turbo through the in-process runtime (caption encoder node, denoise Loop, VAE node) on
a tiny random checkpoint in the diffusers layout, against diffusers' ZImagePipeline with the same
weights, prompt, seed and steps: the final latents and the decoded image. Also: concurrent
requests share denoise forwards and each equals its solo result, and bad requests get errors
naming the field."""

from __future__ import annotations

import asyncio
import io
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.config import parse_config
from mstar.contract import ImageSpec, RequestError
from mstar.runtime.launch import start

HEIGHT, WIDTH = 32, 48  # VAE scale 4 here: sizes are multiples of 8


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = start(parse_config({"model": "z_image_turbo", "model_path": str(checkpoint.root), "max_concurrent_requests": 4,
                            "model_kwargs": {"max_image_area": 64 * 64}}), in_process=True)
    yield d
    d.close()


def engine(d, node):
    return d.runtime.workers.workers[0].engines[node]


def generate(d, spec) -> list[bytes]:
    return asyncio.run(d.backend.generate_images(spec))


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


@contextmanager
def vae_inputs(d):
    """Collect the latents the VAE node decodes (the walk's final latents)."""
    vae = engine(d, "vae")
    seen: dict[str, torch.Tensor] = {}
    original = vae.run

    def run(items):
        seen.update({item.request_id: item.inputs["latents"].clone() for item in items})
        return original(items)

    vae.run = run
    try:
        yield seen
    finally:
        del vae.run


@pytest.mark.parametrize("prompt, seed, steps", [("a cat", 7, 3), ("a cat at a castle at night", 11, 8)])
def test_runtime_matches_diffusers_pipeline(checkpoint, deployment, prompt, seed, steps):
    spec = ImageSpec(f"p-{seed}", prompt, WIDTH, HEIGHT, 1, seed, None if steps == 8 else steps)
    with vae_inputs(deployment) as seen:
        [png] = generate(deployment, spec)
    [ours] = seen.values()

    def run(output_type):
        return checkpoint.pipeline()(prompt=prompt, height=HEIGHT, width=WIDTH, num_inference_steps=steps,
                                     guidance_scale=0.0, generator=torch.Generator().manual_seed(seed),
                                     output_type=output_type).images

    want = run("latent")[0]
    assert ours.shape == want.shape == (4, HEIGHT // 4, WIDTH // 4)
    err = ((ours - want).abs().max() / want.abs().max()).item()
    print(f"[parity] latents rel err {err:.2e}")
    assert err <= 1e-5, f"latents: relative error {err:.2e}"
    image = np.round(run("np")[0] * 255).astype(np.int16)
    assert pixels(png).shape == image.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(pixels(png) - image).max() <= 1  # uint8 rounding of the same image


def test_four_concurrent_requests_share_denoise_forwards(deployment):
    prompts = ["a dog", "a cat at a castle", "hi", "a very long prompt about a cat and a castle " * 3]
    specs = [ImageSpec(f"c-{i}", p, WIDTH, HEIGHT, 1, 100 + i, 2) for i, p in enumerate(prompts)]

    async def together():
        return await asyncio.gather(*[deployment.backend.generate_images(s) for s in specs])

    dit = engine(deployment, "dit")
    before = len(dit.forward_rows)
    with vae_inputs(deployment) as batched_latents:
        batched = asyncio.run(together())
    rows = list(dit.forward_rows)[before:]
    print("[batch] forward rows", rows)
    # 4 requests x 2 steps = 8 DiT rows, in fewer forwards: requests share them. (Each request is
    # tokenised off the event loop, so one may start a step ahead; rows at different steps still
    # share a forward. Typically rows == [4, 4].)
    assert sum(rows) == 4 * 2 and len(rows) < 4 * 2 and max(rows) >= 2, rows
    for spec, [png] in zip(specs, batched):
        with vae_inputs(deployment) as solo_latents:
            [alone] = generate(deployment, ImageSpec(spec.request_id + "-alone", spec.prompt, WIDTH, HEIGHT, 1,
                                                     spec.seed, 2))
        # Equal up to float32 rounding (BLAS sums in another order at another batch size).
        [want], got = solo_latents.values(), batched_latents[spec.request_id + "-0"]  # the backend's id
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert np.abs(pixels(png) - pixels(alone)).max() <= 1
    assert len({bytes(b[0]) for b in batched}) == 4  # different prompts and seeds, different images
    assert not dit.schedules  # per-request state released


@pytest.mark.parametrize("spec, field", [
    (ImageSpec("e-1", " "), "prompt"),
    (ImageSpec("e-2", "x", 36, 32), "size"),  # not a multiple of 2 x the VAE scale (8 here)
    (ImageSpec("e-3", "x", 72, 64), "size"),  # over max_image_area
    (ImageSpec("e-4", "x", 32, 32, num_inference_steps=0), "num_inference_steps"),
    (ImageSpec("e-5", "x", 32, 32, guidance_scale=4.0), "guidance_scale"),
    (ImageSpec("e-6", "x", 32, 32, images=[b"png"]), "image"),
])
def test_bad_requests_name_the_field(deployment, spec, field):
    with pytest.raises(RequestError) as err:
        generate(deployment, spec)
    assert err.value.field == field
