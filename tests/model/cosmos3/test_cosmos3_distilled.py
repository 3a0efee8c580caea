"""The fixed-sigma stochastic sampler of Cosmos3's 4-step distilled checkpoints: its schedule and
steps against diffusers' ``FlowMatchEulerDiscreteScheduler`` (``stochastic_sampling``, custom
sigmas) driven with the same generator, and a distilled deployment (the tiny checkpoint with
``distilled_sigmas`` and a stochastic scheduler) through the in-process runtime against a
reference loop built from diffusers' parts as the distilled modular pipeline runs them
(``Cosmos3OmniTransformer`` on the pipeline's packing, the scheduler stepping with the request's
generator): every step's latents within 1e-5. Guidance and step counts other than the baked
ones are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.model.cosmos3.sampler import FixedSigmas, draws
from mstar.runtime.launch import start
from tests.support.cosmos3_media import step_latents

pytest.importorskip("diffusers")

SIGMAS = [1.0, 0.9375, 0.8333, 0.5]
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 2.0,
             "use_dynamic_shifting": False, "stochastic_sampling": True}
HEIGHT, WIDTH = 48, 32


def reference_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
    scheduler.set_timesteps(sigmas=SIGMAS, device="cpu")
    return scheduler


def test_sampler_matches_the_scheduler():
    ours = FixedSigmas.from_config(SCHEDULER, SIGMAS)
    ref = reference_scheduler()
    sigmas, timesteps = ours.timesteps()
    assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps)
    noise = draws((2, 3, 4), 5, len(SIGMAS) + 1)
    generator = torch.Generator().manual_seed(5)
    x_ref = torch.randn((1, 2, 3, 4), generator=generator)
    x = noise[0]
    assert torch.equal(x, x_ref[0])
    for i, t in enumerate(ref.timesteps):
        v = torch.randn((2, 3, 4), generator=torch.Generator().manual_seed(100 + i))
        x_ref = ref.step(v[None], t, x_ref, generator=generator, return_dict=False)[0]
        x = ours.step(x, v, sigmas[i], sigmas[i + 1], noise[i + 1])
        assert (x - x_ref[0]).abs().max() <= 1e-6 * x_ref.abs().max()


def test_a_deterministic_scheduler_is_refused():
    with pytest.raises(ValueError, match="stochastic_sampling"):
        FixedSigmas.from_config({**SCHEDULER, "stochastic_sampling": False}, SIGMAS)


@pytest.fixture(scope="module")
def distilled(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("cosmos3-4step") / "ckpt"
    shutil.copytree(checkpoint.root, root)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    (root / "modular_model_index.json").write_text(json.dumps({"distilled_sigmas": SIGMAS, "is_distilled": True}))
    d = start(parse_config({"model": "cosmos3_super_t2i_4step", "model_path": str(root),
                            "max_concurrent_requests": 2, "model_kwargs": {"max_image_area": 64 * 64}}),
              in_process=True)
    yield d
    d.close()


def reference_run(checkpoint, prompt, frames, seed, fps=24.0):
    """The distilled loop from diffusers' parts: the prompt as the pipeline tokenizes it (the
    negative branch is built but unused: guidance is baked in), the pipeline's packing, the
    transformer on the conditional branch, the stochastic scheduler on the request's generator."""
    from diffusers import Cosmos3OmniPipeline

    pipe = checkpoint.pipeline()
    ref = checkpoint.transformer
    ids, _ = pipe.tokenize_prompt(prompt, None, num_frames=frames, height=HEIGHT, width=WIDTH, fps=fps)
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn((1, 4, (frames - 1) // 4 + 1, HEIGHT // 16, WIDTH // 16), generator=generator)
    host = SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(host, ids, device="cpu")
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        host, latents, has_image_condition=False, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps, curr=text["und_len"], device="cpu", condition_frame_indexes=[])
    scheduler = reference_scheduler()
    steps = []
    with torch.no_grad():
        for t in scheduler.timesteps:
            v = ref(input_ids=text["input_ids"], text_indexes=text["text_indexes"],
                    position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
                    und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
                    vision_tokens=[latents], vision_token_shapes=vision["vision_token_shapes"],
                    vision_sequence_indexes=vision["vision_sequence_indexes"],
                    vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
                    vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), t.item()),
                    vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False)[0][0]
            latents = scheduler.step(v.unsqueeze(0), t, latents.unsqueeze(0), generator=generator,
                                     return_dict=False)[0].squeeze(0)
            steps.append(latents[0].clone())
    return steps


@pytest.mark.parametrize("frames", [1, 5])
def test_distilled_walk_matches_the_reference_loop(checkpoint, distilled, frames):
    async def go():
        data = b""
        spec = GenerateSpec(f"d-{frames}", "a cat walks on the moon", [], ["video"],
                            {"height": HEIGHT, "width": WIDTH, "num_frames": frames, "seed": 11})
        async for event in distilled.backend.generate(spec):
            assert not event.error, event.error
            data += event.data or b""
        return data

    with step_latents(distilled) as seen:
        data = asyncio.run(go())
    assert len(data) == frames * HEIGHT * WIDTH * 3
    want = reference_run(checkpoint, "a cat walks on the moon", frames, 11)
    assert len(seen) == len(want) == len(SIGMAS)
    for i, (got, ref) in enumerate(zip(seen, want)):
        err = float((got - ref).abs().max() / ref.abs().max())
        print(f"[parity] distilled frames={frames} step {i}: latents rel err {err:.2e}")
        assert err <= 1e-5


@pytest.mark.parametrize("kwargs, field", [({"guidance_scale": 3.0}, "guidance_scale"),
                                           ({"num_inference_steps": 8}, "num_inference_steps")])
def test_baked_settings_are_enforced(distilled, kwargs, field):
    spec = GenerateSpec("bad", "a cat", [], ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 1, **kwargs})
    with pytest.raises(RequestError) as err:
        distilled.backend.spec.prepare_generate(spec)
    assert err.value.field == field
