"""FLUX.2 [klein] editing (the ``edit`` walk: reference images VAE-encoded beside the text
encoder, their tokens conditioning every denoise step) against diffusers'
``Flux2KleinPipeline(image=[...])`` on the tiny random checkpoint of test_flux2_klein_walk."""

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image
from test_flux2_klein_walk import pixels, reference  # noqa: F401  (reference: the tiny checkpoint fixture)

from mstar.config import parse_config
from mstar.contract import ImageSpec, RequestError
from mstar.engine.base import EngineItem
from mstar.model.flux2.edit import MAX_REFERENCE_AREA, prepare_reference
from mstar.model.flux2.vae import unpack_latents
from mstar.model.registry import model_class
from mstar.runtime.launch import start
from tests.support.packing import held_until

PROMPT, SEED, STEPS, WIDTH, HEIGHT = "make it blue", 3, 3, 48, 32


def photo(width, height, seed):
    """A smooth random RGB image (gradients and blobs survive a tiny VAE better than noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = [np.sin(x * rng.uniform(2, 9) + y * rng.uniform(2, 9) + rng.uniform(0, 6)) for _ in range(3)]
    pixels = (np.stack(channels, -1) * 0.45 + 0.5 + rng.normal(0, 0.03, (height, width, 3))) * 255
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def png(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


REFERENCES = [photo(70, 90, 0), photo(96, 64, 1)]  # the first is cropped to 68x88


def pipeline(reference):  # noqa: F811
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    root, vae, dit, text, tok = reference
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    pipe = Flux2KleinPipeline(scheduler, vae, text, tok, dit, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(reference, images, output_type):  # noqa: F811
    return pipeline(reference)(prompt=PROMPT, image=images, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                               guidance_scale=1.0, generator=torch.Generator().manual_seed(SEED),
                               output_type=output_type).images


@pytest.fixture(scope="module")
def model(reference):  # noqa: F811
    spec = model_class("flux2_klein")(parse_config({"model": "flux2_klein", "model_path": str(reference[0]),
                                                    "model_kwargs": {"max_image_area": 128 * 128}}))
    spec.load_frontend()
    return spec, spec.build_engines({"text_encoder", "dit", "vae"}, torch.device("cpu"))


@pytest.fixture(scope="module")
def deployment(reference):  # noqa: F811
    d = start(parse_config({"model": "flux2_klein", "model_path": str(reference[0]), "max_concurrent_requests": 4,
                            "model_kwargs": {"max_image_area": 128 * 128}}), in_process=True)
    yield d
    d.close()


def walk_by_hand(model, images):
    """The edit walk's steps run on the engines directly: the final latent tokens."""
    spec, engines = model
    request = spec.prepare_image(ImageSpec("hand", PROMPT, WIDTH, HEIGHT, 1, SEED, STEPS, images=images))
    assert request.walk == "edit"

    def run(node, op, inputs, iteration=0):
        [out] = engines[node].run([EngineItem("hand", op, iteration, inputs, request.params)])
        return out.outputs

    text = run("text_encoder", "forward", {k: request.inputs[k] for k in ("prompt_ids", "prompt_mask")})["text"]
    references = run("vae", "encode", {"reference_pixels": request.inputs["reference_pixels"]})["references"]
    latents = request.inputs["latents"].result()  # drawn on a background thread
    for k in range(STEPS):
        latents = run("dit", "step", {"latents": latents, "text": text, "references": references}, k)["latents"]
    engines["dit"].release("hand")
    return request, latents


@pytest.mark.parametrize("count", [1, 2])
def test_edit_latents_match_the_pipeline(reference, model, count):  # noqa: F811
    images = REFERENCES[:count]
    request, tokens = walk_by_hand(model, [png(image) for image in images])
    assert tokens.shape == (request.params["rows"] * request.params["cols"], 16)  # references stripped
    vae = reference[1]
    mean, std = vae.bn.running_mean, torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps)
    ours = unpack_latents(tokens[None], request.params["rows"], request.params["cols"], mean, std)
    want = run_pipeline(reference, images, "latent")
    assert ours.shape == want.shape
    assert (ours - want).norm() / want.norm() <= 1e-5


@pytest.mark.parametrize("count", [1, 2])
def test_edit_image_through_the_runtime(reference, deployment, count):  # noqa: F811
    images = REFERENCES[:count]
    [out] = asyncio.run(deployment.backend.generate_images(
        ImageSpec(f"edit-{count}", PROMPT, WIDTH, HEIGHT, 1, SEED, STEPS, images=[png(i) for i in images])))
    ours = np.asarray(Image.open(io.BytesIO(out)).convert("RGB")).astype(np.int16)
    want = np.round(run_pipeline(reference, images, "np")[0] * 255).astype(np.int16)
    assert ours.shape == want.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(ours - want).max() <= 1  # uint8 rounding of the same image


def test_references_change_the_image_and_batch_with_their_solo_result(deployment):
    plain = ImageSpec("plain", PROMPT, WIDTH, HEIGHT, 1, SEED, 2)
    one = ImageSpec("one", PROMPT, WIDTH, HEIGHT, 1, SEED, 2, images=[png(REFERENCES[0])])

    async def together():
        specs = [ImageSpec(f"b-{i}", PROMPT, WIDTH, HEIGHT, 1, SEED + i, 2, images=[png(REFERENCES[0])])
                 for i in range(3)]
        return await asyncio.gather(*[deployment.backend.generate_images(s) for s in specs])

    dit = deployment.runtime.workers.workers[0].engines["dit"]
    before = len(dit.forward_rows)
    with held_until(dit, 2):
        batched = asyncio.run(together())
    assert max(list(dit.forward_rows)[before:]) > 1  # the three edits shared denoise forwards
    [alone] = asyncio.run(deployment.backend.generate_images(
        ImageSpec("b-alone", PROMPT, WIDTH, HEIGHT, 1, SEED + 1, 2, images=[png(REFERENCES[0])])))
    # the same maths; a batched fp32 GEMM may round a pixel one level the other way
    assert np.abs(pixels(batched[1][0]) - pixels(alone)).max() <= 1
    [t2i] = asyncio.run(deployment.backend.generate_images(plain))
    [edited] = asyncio.run(deployment.backend.generate_images(one))
    assert t2i != edited
    assert not dit.schedules


def test_reference_preparation_matches_the_pipeline_processor():
    """Scaling to 1024x1024 pixels (Lanczos) and the centre crop to a multiple of 16."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    processor = Flux2ImageProcessor(vae_scale_factor=16)
    for image in (photo(1100, 1030, 5), photo(300, 130, 6)):
        ours = prepare_reference(image, 16)
        width, height = image.size
        if width * height > MAX_REFERENCE_AREA:
            image = processor._resize_to_target_area(image, MAX_REFERENCE_AREA)
        w, h = image.width // 16 * 16, image.height // 16 * 16
        want = processor.preprocess(image, height=h, width=w, resize_mode="crop")  # [1, 3, h, w] in [-1, 1]
        assert ours.shape == (3, h, w)
        assert torch.equal(ours.float()[None] / 255 * 2 - 1, want)


@pytest.mark.parametrize("images, rule", [
    ([b"not an image"], "not an image"),
    ([png(photo(40, 80, 2))], "at least 64"),
    ([png(photo(600, 70, 2))], "aspect ratio"),
    ([png(REFERENCES[0])] * 5, "at most 4"),
])
def test_bad_references_name_the_image_field(model, images, rule):
    spec, _ = model
    with pytest.raises(RequestError) as err:
        spec.prepare_image(ImageSpec("bad", PROMPT, WIDTH, HEIGHT, images=images))
    assert err.value.field == "image" and rule in err.value.message
