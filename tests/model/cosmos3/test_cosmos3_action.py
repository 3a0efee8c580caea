"""Cosmos3's action modes through the in-process runtime on a tiny random checkpoint with action
heads (``cosmos3_droid``), against diffusers 0.42.1 ``Cosmos3OmniPipeline(action=
CosmosActionCondition(...))`` given the same observation, weights, prompt, seed and steps: the
policy's and inverse dynamics' action chunks, forward dynamics' every-step latents and frames.
Also the observation canvas, the caption and the refused requests (each naming its field)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.model.cosmos3 import action as act
from mstar.runtime.launch import start
from tests.support.cosmos3_media import generate_action as run
from tests.support.cosmos3_media import picture, png, step_latents
from tests.support.packing import held_until

pytest.importorskip("diffusers")

CHUNK = 8


@pytest.fixture(scope="module")
def deployment(action_checkpoint):
    d = start(parse_config({"model": "cosmos3_droid", "model_path": str(action_checkpoint.root),
                            "max_concurrent_requests": 4,
                            "model_kwargs": {"num_inference_steps": 3, "guidance_scale": 3.0,
                                             "domain_name": "droid_lerobot", "action_chunk_size": CHUNK}}),
              in_process=True)
    yield d
    d.close()


def clip_mp4(frames: int, width: int, height: int) -> bytes:
    from mstar.media.video import encode_mp4

    return encode_mp4(np.stack([np.asarray(picture(width, height, 20 + i)) for i in range(frames)]), fps=15)


def reference(checkpoint, prompt, steps, guidance, seed, fps=24.0, chunk=CHUNK, **condition):
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    want: list[torch.Tensor] = []

    def record(pipe, i, t, kwargs):
        want.append(kwargs["latents"].clone())
        return {}

    out = checkpoint.pipeline()(
        prompt=prompt, negative_prompt="", action=CosmosActionCondition(chunk_size=chunk, domain_name="droid_lerobot",
                                                                       resolution_tier=256, **condition),
        fps=fps, num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
        output_type="np", callback_on_step_end=record)
    return want, out


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("source, guidance, steps", [((64, 48), 3.0, 3), ((405, 301), 1.0, 2)],
                         ids=["guided_padded", "unguided_scaled_down"])
def test_policy_matches_the_pipeline(action_checkpoint, deployment, source, guidance, steps):
    prompt, seed = "pick up the red cup", 4
    image = picture(*source, seed=1)
    with step_latents(deployment) as seen:
        out = run(deployment, f"policy-{source}", prompt, [("image", png(image))], ["action", "video"], seed=seed,
                  num_inference_steps=steps, guidance_scale=guidance)
    want, ref = reference(action_checkpoint, prompt, steps, guidance, seed, mode="policy", image=image)
    got = torch.from_numpy(np.frombuffer(out["action"], dtype="<f4").reshape(CHUNK, 10).copy())
    expected = ref.action[0].float()
    assert expected.shape == (CHUNK, 10)
    err = rel(got, expected)
    print(f"[parity] policy {source}: actions rel err {err:.2e}")
    assert err <= 1e-5
    for i, (a, b) in enumerate(zip(seen, want, strict=True)):
        assert a.shape == b.shape[1:]
        assert rel(a, b[0]) <= 1e-5, (i, rel(a, b[0]))
    video = np.round(np.asarray(ref.video) * 255).astype(np.int16)  # the predicted clip, asked for too
    frames = np.frombuffer(out["video"], dtype=np.uint8).reshape(video.shape).astype(np.int16)
    print(f"[parity] policy {source}: predicted clip {video.shape}, max diff {np.abs(frames - video).max()} levels")
    assert np.abs(frames - video).max() <= 1


def test_inverse_dynamics_matches_the_pipeline(action_checkpoint, deployment):
    from mstar.media.video import decode_mp4

    prompt, seed = "the arm moves left", 9
    mp4 = clip_mp4(CHUNK + 1, 64, 48)
    frames, _ = decode_mp4(mp4)
    out = run(deployment, "inverse", prompt, [("video", mp4)], ["action"], action_mode="inverse_dynamics", seed=seed)
    _, ref = reference(action_checkpoint, prompt, 3, 3.0, seed, mode="inverse_dynamics",
                       video=[Image.fromarray(f) for f in frames])
    got = torch.from_numpy(np.frombuffer(out["action"], dtype="<f4").reshape(CHUNK, 10).copy())
    err = rel(got, ref.action[0].float())
    print(f"[parity] inverse dynamics: actions rel err {err:.2e}")
    assert err <= 1e-5


def test_inverse_dynamics_pads_a_short_clip(action_checkpoint, deployment):
    from mstar.media.video import decode_mp4

    prompt, seed = "the gripper closes", 2
    mp4 = clip_mp4(5, 64, 48)
    frames, _ = decode_mp4(mp4)
    out = run(deployment, "inverse-short", prompt, [("video", mp4)], ["action"], action_mode="inverse_dynamics",
              seed=seed, num_inference_steps=2, guidance_scale=1.0)
    _, ref = reference(action_checkpoint, prompt, 2, 1.0, seed, mode="inverse_dynamics",
                       video=[Image.fromarray(f) for f in frames])
    got = torch.from_numpy(np.frombuffer(out["action"], dtype="<f4").reshape(CHUNK, 10).copy())
    assert rel(got, ref.action[0].float()) <= 1e-5


def test_forward_dynamics_matches_the_pipeline(action_checkpoint, deployment):
    prompt, seed = "push the block", 6
    image = picture(64, 48, seed=3)
    raw = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))  # 5 of 8: the last one repeats
    with step_latents(deployment) as seen:
        out = run(deployment, "forward", prompt, [("image", png(image))], ["video"], action_mode="forward_dynamics",
                  raw_actions=raw.tolist(), seed=seed)
    want, ref = reference(action_checkpoint, prompt, 3, 3.0, seed, mode="forward_dynamics", image=image,
                          raw_actions=raw)
    assert ref.action is None and len(seen) == len(want) == 3
    for i, (a, b) in enumerate(zip(seen, want)):
        err = rel(a, b[0])
        print(f"[parity] forward dynamics step {i}: latents rel err {err:.2e}")
        assert err <= 1e-5
    video = np.round(np.asarray(ref.video) * 255).astype(np.int16)  # [F, H, W, 3]
    got = np.frombuffer(out["video"], dtype=np.uint8).reshape(video.shape).astype(np.int16)
    print(f"[parity] forward dynamics frames max diff {np.abs(got - video).max()} levels")
    assert np.abs(got - video).max() <= 1


def test_caption_equals_the_pipeline(action_checkpoint):
    from diffusers import Cosmos3OmniPipeline

    from mstar.model.cosmos3.checkpoint import Cosmos3Checkpoint

    for view, frames, fps in (("ego_view", 33, 24.0), ("wrist_view", 9, 15.0), ("nowhere", 129, 2.0)):
        want = Cosmos3OmniPipeline._build_action_json_prompt("grab the cup", view_point=view, num_frames=frames,
                                                             fps=fps, height=256, width=320)
        assert act.action_caption("grab the cup", view_point=view, num_frames=frames, fps=fps, height=256,
                                  width=320) == want
    pipe = action_checkpoint.pipeline()
    cond, uncond = pipe.tokenize_prompt("grab the cup", "blurry", num_frames=9, height=256, width=320, fps=24.0,
                                        action_mode="policy", action_view_point="ego_view")
    prompt = Cosmos3Checkpoint(action_checkpoint.root).prompt()
    caption = act.action_caption("grab the cup", view_point="ego_view", num_frames=9, fps=24.0, height=256, width=320)
    assert prompt.chat_ids(caption).tolist() == cond
    assert prompt.chat_ids("blurry").tolist() == uncond


@pytest.mark.parametrize("size, tier", [((64, 48), 256), ((405, 301), 256), ((300, 500), 480), ((50, 50), 704)])
def test_observation_canvas_equals_the_pipeline(action_checkpoint, size, tier):
    pipe = action_checkpoint.pipeline()
    image = picture(*size, seed=5)
    want, image_size, h, w = pipe._prepare_action_video_conditioning([image], tier, 5, device="cpu",
                                                                     dtype=torch.float32)
    got, canvas, content = act.observation_pixels([np.asarray(image)], 5, tier)
    assert canvas == (h, w) and list(content) == [int(v) for v in image_size[2:].tolist()]
    assert torch.allclose(got, want[0], atol=1e-6)


@pytest.mark.parametrize("files, modalities, kwargs, field", [
    ([], ["action"], {}, "image"),
    ([("video", b"")], ["action"], {"action_mode": "inverse_dynamics"}, "video"),
    ("image", ["action"], {"action_mode": "inverse_dynamics"}, "video"),
    ("image", ["action"], {"domain_name": "mars_rover"}, "domain_name"),
    ("image", ["action"], {"domain_name": "hand_pose"}, "domain_name"),  # 57-wide: over the 12-wide heads
    ("image", ["action"], {"raw_action_dim": 7}, "raw_action_dim"),
    ("image", ["action"], {"action_chunk_size": 0}, "action_chunk_size"),
    ("image", ["action"], {"action_chunk_size": 4096}, "action_chunk_size"),
    ("image", ["video"], {"action_mode": "forward_dynamics"}, "raw_actions"),
    ("image", ["video"], {"action_mode": "forward_dynamics", "raw_actions": [[0.0] * 9]}, "raw_actions"),
    ("image", ["video"], {"action_mode": "policy"}, "output_modalities"),
    ("image", ["action", "video"], {"action_mode": "forward_dynamics", "raw_actions": [[0.0] * 10]},
     "output_modalities"),
    ("image", ["action"], {"resolution_tier": 300}, "resolution_tier"),
])
def test_bad_action_requests_name_the_field(deployment, files, modalities, kwargs, field):
    if files == "image":
        files = [("image", png(picture(64, 48, seed=1)))]
    spec = GenerateSpec("bad", "pick it up", files, modalities, kwargs)
    with pytest.raises(RequestError) as err:
        deployment.backend.spec.prepare_generate(spec)
    assert err.value.field == field, err.value


def test_concurrent_requests_equal_their_solo_runs(deployment):
    image, mp4 = png(picture(64, 48, seed=2)), clip_mp4(CHUNK + 1, 64, 48)
    jobs = [("c-policy", [("image", image)], ["action"], {"seed": 1}),
            ("c-inverse", [("video", mp4)], ["action"], {"seed": 2, "action_mode": "inverse_dynamics"}),
            ("c-forward", [("image", image)], ["video"], {"seed": 3, "action_mode": "forward_dynamics",
                                                          "raw_actions": [[0.1 * i] * 10 for i in range(CHUNK)]}),
            ("c-policy-2", [("image", image)], ["action"], {"seed": 4, "action_chunk_size": 4})]
    solo = [run(deployment, rid + "-solo", "go", files, mods, **kw) for rid, files, mods, kw in jobs]
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    before = len(dit.forward_rows)

    async def together():
        async def one(rid, files, mods, kw):
            return await asyncio.to_thread(run, deployment, rid, "go", files, mods, **kw)
        return await asyncio.gather(*(one(*job) for job in jobs))

    with held_until(dit, 2):
        packed = asyncio.run(together())
    assert max(list(dit.forward_rows)[before:]) > 2  # some forwards held more than one request
    for a, b in zip(solo, packed):
        assert a.keys() == b.keys()
        for key in a:
            x = np.frombuffer(a[key], dtype="<f4" if key == "action" else np.uint8).astype(np.float64)
            y = np.frombuffer(b[key], dtype="<f4" if key == "action" else np.uint8).astype(np.float64)
            tol = 1e-5 * np.abs(x).max() if key == "action" else 1
            assert np.abs(x - y).max() <= tol, key
    assert json.dumps(np.frombuffer(packed[3]["action"], dtype="<f4").reshape(4, 10).tolist())


@pytest.mark.parametrize("mode", ["policy", "inverse_dynamics", "forward_dynamics"])
def test_a_chunk_off_the_vae_grid_matches_the_pipeline(action_checkpoint, deployment, mode):
    """6 actions: the clip is 7 frames, of which the VAE codes 5 (2 latent frames)."""
    from mstar.media.video import decode_mp4

    prompt, seed, chunk = "wipe the table", 12, 6
    if mode == "inverse_dynamics":
        mp4 = clip_mp4(chunk + 1, 64, 48)
        files, condition = [("video", mp4)], {"video": [Image.fromarray(f) for f in decode_mp4(mp4)[0]]}
    else:
        image = picture(64, 48, seed=8)
        files, condition = [("image", png(image))], {"image": image}
    kwargs = {}
    if mode == "forward_dynamics":
        raw = torch.randn(chunk, 10, generator=torch.Generator().manual_seed(1))
        kwargs, condition = {"raw_actions": raw.tolist()}, {**condition, "raw_actions": raw}
    out = run(deployment, f"off-grid-{mode}", prompt, files, ["video" if mode == "forward_dynamics" else "action"],
              action_mode=mode, action_chunk_size=chunk, seed=seed, num_inference_steps=2, **kwargs)
    _, ref = reference(action_checkpoint, prompt, 2, 3.0, seed, chunk=chunk, mode=mode, **condition)
    if mode == "forward_dynamics":
        video = np.round(np.asarray(ref.video) * 255).astype(np.int16)
        assert video.shape == (5, 48, 64, 3)
        got = np.frombuffer(out["video"], dtype=np.uint8).reshape(video.shape).astype(np.int16)
        assert np.abs(got - video).max() <= 1
    else:
        got = torch.from_numpy(np.frombuffer(out["action"], dtype="<f4").reshape(chunk, 10).copy())
        err = rel(got, ref.action[0].float())
        print(f"[parity] {mode} chunk {chunk}: actions rel err {err:.2e}")
        assert err <= 1e-5
