"""Cosmos3 t2i / t2v through the in-process runtime (the tower as a UniPC denoise Loop with the
guided pair in one forward, the Wan2.2 VAE decode) on a tiny random checkpoint in the released
layout, against diffusers' ``Cosmos3OmniPipeline`` with the same weights, prompts, seed and
steps: the latents after every step and the decoded frames. Also: concurrent requests of
different sizes share forwards and equal their solo runs; bad requests name the field."""

from __future__ import annotations

import asyncio
import io
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.runtime.launch import start
from tests.support.packing import held_until

pytest.importorskip("diffusers")

HEIGHT, WIDTH = 48, 32  # latents [4, T, 3, 2]: 2 x 1 patches a frame, the row padded


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = start(parse_config({"model": "cosmos3", "model_path": str(checkpoint.root), "max_concurrent_requests": 4,
                            "model_kwargs": {"max_video_pixels": 64 * 64 * 9, "max_image_area": 64 * 64}}),
              in_process=True)
    yield d
    d.close()


def engine(d, node):
    return d.runtime.workers.workers[0].engines[node]


def generate(d, request_id, prompt, modality="video", **kwargs) -> bytes:
    async def run():
        data = b""
        spec = GenerateSpec(request_id, prompt, [], [modality], {"height": HEIGHT, "width": WIDTH, **kwargs})
        async for event in d.backend.generate(spec):
            assert not event.error, event.error
            data += event.data or b""
        return data

    return asyncio.run(run())


def frames_of(data: bytes, frames: int) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).reshape(frames, HEIGHT, WIDTH, 3).astype(np.int16)


@contextmanager
def step_latents(d):
    """Collect the latents the denoise engine writes at every step, per request."""
    dit = engine(d, "dit")
    seen: dict[str, list[torch.Tensor]] = {}
    original = dit.run

    def run(items):
        outputs = original(items)
        for item, out in zip(items, outputs):
            seen.setdefault(item.request_id, []).append(out.outputs["latents"].clone())
        return outputs

    dit.run = run
    try:
        yield seen
    finally:
        del dit.run


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("frames, guidance, steps, modality", [(9, 4.0, 3, "video"), (1, 6.0, 3, "image"),
                                                                (5, 1.0, 2, "video"), (1, 2.0, 2, "video")],
                         ids=["t2v_guided", "t2i_guided", "t2v_unguided", "one_frame_video"])
def test_runtime_matches_diffusers_pipeline(checkpoint, deployment, frames, guidance, steps, modality):
    prompt, seed = "a cat walks on the moon", 7
    fps = 24 if modality == "image" else 16  # an image request takes the pipeline's default rate
    extra = {} if modality == "image" else {"num_frames": frames, "fps": fps}
    with step_latents(deployment) as seen:
        data = generate(deployment, f"p-{frames}-{guidance}-{modality}", prompt, modality, seed=seed,
                        num_inference_steps=steps, guidance_scale=guidance, **extra)
    [ours] = seen.values()

    want: list[torch.Tensor] = []

    def record(pipe, i, t, kwargs):
        want.append(kwargs["latents"].clone())
        return {}

    out = checkpoint.pipeline()(prompt=prompt, negative_prompt="", height=HEIGHT, width=WIDTH, num_frames=frames,
                                fps=fps, num_inference_steps=steps, guidance_scale=guidance,
                                generator=torch.Generator().manual_seed(seed), output_type="np",
                                callback_on_step_end=record)
    assert len(ours) == len(want) == steps
    for i, (got, ref) in enumerate(zip(ours, want)):
        assert got.shape == ref.shape[1:] == (4, (frames - 1) // 4 + 1, HEIGHT // 16, WIDTH // 16)
        err = rel(got, ref[0])
        print(f"[parity] frames={frames} guidance={guidance} step {i}: latents rel err {err:.2e}")
        assert err <= 1e-5
    video = np.round(np.asarray(out.video) * 255).astype(np.int16)
    if modality == "image":
        got = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)[None]
    else:
        got = frames_of(data, frames)
    assert got.shape == video.shape == (frames, HEIGHT, WIDTH, 3)
    print(f"[parity] frames max diff {np.abs(got - video).max()} levels")
    assert np.abs(got - video).max() <= 1


def test_concurrent_requests_share_forwards_and_equal_solo_runs(deployment):
    dit = engine(deployment, "dit")
    jobs = [("a", "a cat walks on the moon", 9, 1), ("b", "a dog", 5, 2), ("c", "the floor", 1, 3)]
    alone = {rid: generate(deployment, f"solo-{rid}", p, "video", num_frames=n, seed=s, num_inference_steps=2,
                           guidance_scale=3.0) for rid, p, n, s in jobs}
    dit.forward_rows.clear()

    async def together():
        async def one(rid, prompt, n, seed):
            data = b""
            spec = GenerateSpec(f"batch-{rid}", prompt, [], ["video"],
                                {"height": HEIGHT, "width": WIDTH, "num_frames": n, "seed": seed,
                                 "num_inference_steps": 2, "guidance_scale": 3.0})
            async for event in deployment.backend.generate(spec):
                assert not event.error, event.error
                data += event.data or b""
            return data

        return await asyncio.gather(*(one(*job) for job in jobs))

    with held_until(dit, 2):
        batched = asyncio.run(together())
    assert sum(dit.forward_rows) == 3 * 2 * 2  # 3 requests x 2 steps x the guided pair
    assert max(dit.forward_rows) > 2  # some forward packed rows of different requests and sizes
    for (rid, *_), got in zip(jobs, batched):  # a packed forward rounds as its rows' shapes let it: 1 level
        solo = np.frombuffer(alone[rid], dtype=np.uint8).astype(np.int16)
        assert len(got) == len(alone[rid]) and np.abs(np.frombuffer(got, dtype=np.uint8) - solo).max() <= 1
    assert not dit.prepared and not dit.solvers and not dit.schedules  # per-request state released


@pytest.mark.parametrize("kwargs, field", [
    ({"width": 40}, "width"), ({"height": 8}, "height"), ({"num_frames": 6}, "num_frames"),
    ({"num_frames": 0}, "num_frames"), ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"guidance_scale": 0.5}, "guidance_scale"), ({"num_frames": 13, "width": 64, "height": 64}, "num_frames"),
])
def test_bad_requests_name_the_field(deployment, kwargs, field):
    spec = GenerateSpec("bad", "a cat", [], ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 5, **kwargs})
    with pytest.raises(RequestError) as err:
        deployment.backend.spec.prepare_generate(spec)
    assert err.value.field == field
