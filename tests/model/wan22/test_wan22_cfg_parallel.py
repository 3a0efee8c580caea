"""Wan2.2 with ``cfg_parallel``: each guided step runs the conditional and unconditional
branches as ``Parallel`` steps on nodes ``dit`` and ``dit_uncond`` (on one rank, sharing the
engine, and on two ranks), then ``dit: guide``; the result equals diffusers' pipelines, as the batched pair
does (t2v and TI2V i2v)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_wan22_walk import FRAMES, HEIGHT, WIDTH, make_image, png, vae_inputs

from mstar.config import parse_config
from mstar.contract import GenerateSpec
from mstar.runtime.launch import start

PLACEMENTS = {
    "one-rank": [{"node_names": ["text_encoder", "dit", "dit_uncond", "vae"], "ranks": [0]}],
    "two-ranks": [{"node_names": ["text_encoder", "dit", "vae"], "ranks": [0]},
                  {"node_names": ["dit_uncond"], "ranks": [1]}],
}


@pytest.fixture(scope="module", params=list(PLACEMENTS))
def deployment(request, checkpoint):
    d = start(parse_config({"model": "wan22", "model_path": str(checkpoint.root), "max_concurrent_requests": 4,
                            "node_groups": PLACEMENTS[request.param], "model_kwargs": {"cfg_parallel": True}}),
              in_process=True)
    d.placement_name = request.param
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

    workers = deployment.runtime.workers.workers
    dits = {engine for worker in workers.values() for engine in (worker.engines.get("dit"),
                                                                  worker.engines.get("dit_uncond")) if engine}
    encoded = []
    for engine in dits:
        monkeypatch.setattr(engine, "encode", lambda text, encode=engine.encode: encoded.append(1) or encode(text))
    with vae_inputs(deployment) as seen:
        asyncio.run(run())
    [ours] = seen.values()
    assert len(encoded) == 2  # each branch's prompt once, not once a step (the branches alternate on one rank)
    extra = {"image": make_image(8)} if i2v else {}
    want = checkpoint.pipeline(image=i2v)(
        prompt=prompt, negative_prompt="", height=HEIGHT, width=WIDTH, num_frames=FRAMES,
        num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
        output_type="latent", max_sequence_length=512, **extra).frames[0]
    err = ((ours - want).abs().max() / want.abs().max()).item()
    print(f"[parity] cfg_parallel {deployment.placement_name} i2v={i2v}: latents rel err {err:.2e}")
    assert err <= 1e-5
    dit = workers[0].engines["dit"]
    if deployment.placement_name == "one-rank":
        assert dit is workers[0].engines["dit_uncond"]
    else:
        assert "dit_uncond" not in workers[0].engines and "dit" not in workers[1].engines
        assert not workers[1].engines["dit_uncond"].schedules
    assert not dit.schedules and not dit.solvers and not dit.prompts
    assert np.isfinite(ours.numpy()).all()


@pytest.mark.parametrize("name, uncond_rank", [("wan22.yaml", None), ("wan22_cfg_parallel.yaml", 1)])
def test_example_configs_place_the_guidance_branches(checkpoint, name, uncond_rank):
    from mstar.config import load_config
    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    path = Path(__file__).resolve().parents[3] / "configs" / name
    assert load_config(path).device == "cuda"
    config = load_config(path, {"device": "cpu", "model_path": str(checkpoint.root)})  # no GPU here
    graph = model_class(config.model)(config).graph()
    placement = build_placement(graph, config)  # every node of every walk on an existing rank
    for walk in ("t2v_guided", "i2v_guided"):
        nodes = {step.node for step in graph.walk(walk).steps()}
        assert placement.rank_of(walk, "dit") == 0
        assert ("dit_uncond" in nodes) == (uncond_rank is not None)
        if uncond_rank is not None:
            assert placement.rank_of(walk, "dit_uncond") == uncond_rank
    assert config.num_ranks == (1 if uncond_rank is None else 2)
