"""FLUX.2 [klein] base (classifier-free guidance) through the in-process runtime against
diffusers' Flux2KleinPipeline with is_distilled=False on a tiny random checkpoint: the
batched-pair walk and the Parallel walk (branches on one rank and on two ranks)."""

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_flux2_klein_walk import reference  # noqa: F401  (the tiny diffusers-layout checkpoint)

from mstar.config import ConfigError, load_config, parse_config
from mstar.contract import ImageSpec, RequestError
from mstar.engine.base import Engine
from mstar.runtime.launch import start

PROMPT, SEED, STEPS, HEIGHT, WIDTH = "a cat", 11, 3, 32, 48

LAYOUTS = {
    "pair": ({}, []),
    "parallel-one-rank": ({"cfg_parallel": True}, [{"node_names": ["text_encoder", "dit", "dit_uncond", "vae"],
                                                    "ranks": [0]}]),
    "parallel-two-ranks": ({"cfg_parallel": True}, [{"node_names": ["text_encoder", "dit", "vae"], "ranks": [0]},
                                                    {"node_names": ["dit_uncond"], "ranks": [1]}]),
}


class LatentRecorder(Engine):
    """Wraps the VAE engine and keeps the final latents each request hands it."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.latents: dict[str, torch.Tensor] = {}

    def run(self, items):
        for item in items:
            if item.op == "decode":
                self.latents[item.request_id] = item.inputs["latents"].clone()
        return self.inner.run(items)


def deploy(root, layout, **kwargs):
    model_kwargs, groups = LAYOUTS[layout]
    config = parse_config({"model": "flux2_klein_base", "model_path": str(root), "max_concurrent_requests": 4,
                           "node_groups": groups, "model_kwargs": {**model_kwargs, **kwargs}})
    d = start(config, in_process=True)
    worker = d.runtime.workers.workers[0]
    worker.engines["vae"] = LatentRecorder(worker.engines["vae"])
    return d


def generate(d, spec):
    return asyncio.run(d.backend.generate_images(spec))


def run_pipeline(reference, **kwargs):  # noqa: F811
    """diffusers' non-distilled pipeline at guidance 4 (the base default): its final packed
    latents and its image as uint8 values."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    root, vae, dit, text, tok = reference
    pipe = Flux2KleinPipeline(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
                              vae, text, tok, dit, is_distilled=False)
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def keep(pipeline, i, t, tensors):
        seen["latents"] = tensors["latents"].clone()
        return {}

    image = pipe(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(SEED), output_type="np", callback_on_step_end=keep,
                 callback_on_step_end_tensor_inputs=["latents"], **kwargs).images[0]
    return seen["latents"][0], np.round(image * 255).astype(np.int16)


@pytest.fixture(scope="module")
def diffusers_run(reference):  # noqa: F811
    return run_pipeline(reference)


def gradient(width, height):
    """A smooth RGB reference image (a tiny VAE keeps gradients better than noise)."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200 + 20
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def png_bytes(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def deployment(request, reference):  # noqa: F811
    d = deploy(reference[0], request.param)
    yield d
    d.close()


def test_guided_runtime_matches_diffusers_pipeline(deployment, diffusers_run):
    want_latents, want_image = diffusers_run
    [png] = generate(deployment, ImageSpec("g-1", PROMPT, WIDTH, HEIGHT, 1, SEED, STEPS))
    got = deployment.runtime.workers.workers[0].engines["vae"].latents["g-1-0"]
    assert got.shape == want_latents.shape
    assert (got - want_latents).abs().max() <= 1e-5 * want_latents.abs().max()
    ours = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)
    assert ours.shape == want_image.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(ours - want_image).max() <= 1  # uint8 rounding of the same image
    engines = [engine for w in deployment.runtime.workers.workers.values() for engine in w.engines.values()]
    assert all(not getattr(e, "schedules", None) for e in engines)  # per-request state released


def test_guided_edit_matches_diffusers_pipeline(reference, deployment):  # noqa: F811
    image = gradient(72, 64)
    want_latents, want_image = run_pipeline(reference, image=[image])
    [png] = generate(deployment, ImageSpec("ed-1", PROMPT, WIDTH, HEIGHT, 1, SEED, STEPS, images=[png_bytes(image)]))
    got = deployment.runtime.workers.workers[0].engines["vae"].latents["ed-1-0"]
    assert got.shape == want_latents.shape
    assert (got - want_latents).abs().max() <= 1e-5 * want_latents.abs().max()
    ours = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)
    assert np.abs(ours - want_image).max() <= 1


def test_guidance_changes_the_image_and_one_turns_it_off(deployment, diffusers_run):
    want_latents, _ = diffusers_run
    generate(deployment, ImageSpec("g-2", PROMPT, WIDTH, HEIGHT, 1, SEED, STEPS, guidance_scale=1.0))
    plain = deployment.runtime.workers.workers[0].engines["vae"].latents["g-2-0"]
    assert (plain - want_latents).abs().max() > 1e-2 * want_latents.abs().max()


def test_concurrent_guided_and_plain_requests_equal_their_solo_runs(deployment):
    async def go():
        specs = [ImageSpec(f"c-{i}", "a dog", 32, 32, 1, i, 2, guidance_scale=[4.0, 1.0, 2.5][i]) for i in range(3)]
        return await asyncio.gather(*[deployment.backend.generate_images(s) for s in specs])

    together = asyncio.run(go())
    recorded = deployment.runtime.workers.workers[0].engines["vae"].latents
    batched = recorded["c-0-0"].clone()
    alone = generate(deployment, ImageSpec("c-alone", "a dog", 32, 32, 1, 0, 2, guidance_scale=4.0))
    # batching changes only the last bits (which guidance scales up), never more
    assert (recorded["c-alone-0"] - batched).abs().max() <= 1e-5 * batched.abs().max()
    assert len(together) == 3 and len(alone) == 1


def test_defaults_are_the_base_checkpoints(reference):  # noqa: F811
    from mstar.model.registry import model_class

    spec = model_class("flux2_klein_base")(parse_config({"model": "flux2_klein_base",
                                                          "model_path": str(reference[0])}))
    spec.load_frontend()
    request = spec.prepare_image(ImageSpec("d", "a cat", 32, 32, seed=1))
    assert request.walk == "t2i_guided"
    assert request.params["num_steps"] == 50 and request.params["guidance_scale"] == 4.0
    empty_ids, empty_mask = spec.text.tokenize("")
    assert torch.equal(request.inputs["negative_ids"], empty_ids)
    assert torch.equal(request.inputs["negative_mask"], empty_mask)
    assert spec.prepare_image(ImageSpec("d", "a cat", 32, 32, seed=1, guidance_scale=1.0)).walk == "t2i"


@pytest.mark.parametrize("scale", [0.5, 0.0, float("nan"), float("inf"), "4", True])
def test_bad_guidance_scale_names_the_field(deployment, scale):
    with pytest.raises(RequestError) as err:
        generate(deployment, ImageSpec("e-1", "x", 32, 32, guidance_scale=scale))
    assert err.value.field == "guidance_scale"


def test_cfg_parallel_must_be_a_boolean(reference):  # noqa: F811
    with pytest.raises(ConfigError, match="model_kwargs.cfg_parallel"):
        start(parse_config({"model": "flux2_klein_base", "model_path": str(reference[0]),
                            "model_kwargs": {"cfg_parallel": "yes"}}), in_process=True)


def test_parallel_walk_needs_the_unconditional_branch_placed(reference):  # noqa: F811
    with pytest.raises(ConfigError, match="'dit_uncond'"):
        start(parse_config({"model": "flux2_klein_base", "model_path": str(reference[0]),
                            "node_groups": [{"node_names": ["text_encoder", "dit", "vae"], "ranks": [0]}],
                            "model_kwargs": {"cfg_parallel": True}}), in_process=True)


@pytest.mark.parametrize("name, uncond_rank", [("flux2_klein_base.yaml", None),
                                               ("flux2_klein_base_cfg_parallel.yaml", 1)])
def test_example_configs_place_the_guidance_branches(name, uncond_rank):
    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    assert config.device == "cuda"
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / name, {"device": "cpu"})  # no GPU here
    graph = model_class(config.model)(config).graph()
    placement = build_placement(graph, config)  # every node of every walk on an existing rank
    for walk in ("t2i_guided", "edit_guided"):
        nodes = {step.node for step in graph.walk(walk).steps()}
        assert placement.rank_of(walk, "dit") == 0
        if uncond_rank is None:
            assert "dit_uncond" not in nodes
        else:
            assert placement.rank_of(walk, "dit_uncond") == uncond_rank
    assert config.num_ranks == (1 if uncond_rank is None else 2)
