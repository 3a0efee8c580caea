"""Wan2.2 with ``cfg_parallel``: each guided step runs the conditional and unconditional
branches as ``Parallel`` steps on nodes ``dit`` and ``dit_uncond`` (here on one rank, sharing
the engine), then ``dit: guide``; the result equals diffusers' pipelines, as the batched pair
does (t2v and TI2V i2v)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_wan22_walk import FRAMES, HEIGHT, WIDTH, make_image, png, vae_inputs

from mstar.config import parse_config
from mstar.contract import GenerateSpec
from mstar.runtime.launch import start


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = start(parse_config({"model": "wan22", "model_path": str(checkpoint.root), "max_concurrent_requests": 4,
                            "model_kwargs": {"cfg_parallel": True}}), in_process=True)
    yield d
    d.close()


@pytest.mark.parametrize("i2v", [False, True])
def test_cfg_parallel_matches_diffusers(checkpoint, deployment, monkeypatch, i2v):
    from diffusers.pipelines.wan import pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "ftfy", SimpleNamespace(fix_text=lambda text: text), raising=False)
    assert "dit_uncond" in deployment.spec.graph().nodes
    prompt, seed, steps, guidance = "a dog walks", 9, 3, 4.5
    files = [("image.png", png(make_image(8)))] if i2v else []
    spec = GenerateSpec(f"cfgp-{i2v}", prompt, files, ["video"],
                        {"height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "seed": seed,
                         "num_inference_steps": steps, "guidance_scale": guidance})

    async def run():
        async for event in deployment.backend.generate(spec):
            assert not event.error, event.error

    with vae_inputs(deployment) as seen:
        asyncio.run(run())
    [ours] = seen.values()
    extra = {"image": make_image(8)} if i2v else {}
    want = checkpoint.pipeline(image=i2v)(
        prompt=prompt, negative_prompt="", height=HEIGHT, width=WIDTH, num_frames=FRAMES,
        num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
        output_type="latent", max_sequence_length=512, **extra).frames[0]
    err = ((ours - want).abs().max() / want.abs().max()).item()
    print(f"[parity] cfg_parallel i2v={i2v}: latents rel err {err:.2e}")
    assert err <= 1e-5
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    assert dit is deployment.runtime.workers.workers[0].engines["dit_uncond"]
    assert not dit.schedules and not dit.solvers
    assert np.isfinite(ours.numpy()).all()
