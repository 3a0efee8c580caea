"""Cosmos3 image-to-video and video-to-video through the in-process runtime (the VAE encodes the
conditioning pixels, the tower keeps those latent frames clean) on the tiny random checkpoint,
against diffusers' ``Cosmos3OmniPipeline`` given the same image or clip, weights, prompts, seed
and steps: the latents after every step and the decoded frames. Also: the conditioning image's
cover-and-crop and stretch resizes; the 4-step distilled i2v key (``cosmos3_super_i2v_4step``)
against a reference loop from diffusers' parts; bad conditioned requests name the field."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.model.cosmos3.conditioning import image_pixels
from mstar.runtime.launch import start
from tests.support.cosmos3_media import picture, png, step_latents
from tests.support.packing import held_until

pytest.importorskip("diffusers")

HEIGHT, WIDTH = 48, 32


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = start(parse_config({"model": "cosmos3", "model_path": str(checkpoint.root), "max_concurrent_requests": 4,
                            "model_kwargs": {"max_video_pixels": 64 * 64 * 13, "max_image_area": 64 * 64}}),
              in_process=True)
    yield d
    d.close()


def clip_mp4(frames: int, width: int, height: int) -> bytes:
    from mstar.media.video import encode_mp4

    return encode_mp4(np.stack([np.asarray(picture(width, height, 10 + i)) for i in range(frames)]), fps=16)


def generate(d, request_id, prompt, files, **kwargs) -> bytes:
    async def run():
        data = b""
        spec = GenerateSpec(request_id, prompt, files, ["video"], {"height": HEIGHT, "width": WIDTH, **kwargs})
        async for event in d.backend.generate(spec):
            assert not event.error, event.error
            data += event.data or b""
        return data

    return asyncio.run(run())


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def our_vae(checkpoint):
    from mstar.model.cosmos3.checkpoint import Cosmos3Checkpoint
    from mstar.model.wan22.vae import WanVAE

    ckpt = Cosmos3Checkpoint(checkpoint.root)
    return ckpt.load(lambda: WanVAE(ckpt.vae_config()), "vae", device=torch.device("cpu"), dtype=torch.float32,
                     dummy=False, seed=0)


def reference(checkpoint, prompt, frames, steps, guidance, seed, fps, **condition):
    want: list[torch.Tensor] = []

    def record(pipe, i, t, kwargs):
        want.append(kwargs["latents"].clone())
        return {}

    out = checkpoint.pipeline()(prompt=prompt, negative_prompt="", height=HEIGHT, width=WIDTH, num_frames=frames,
                                fps=fps, num_inference_steps=steps, guidance_scale=guidance,
                                generator=torch.Generator().manual_seed(seed), output_type="np",
                                callback_on_step_end=record, **condition)
    return want, np.asarray(out.video)


def compare(ours, want, data, video, frames, label, vae=None):
    """Every step's latents within 1e-5 relative; the walk's uint8 frames within one level of the
    pipeline's float frames rounded; with ``vae`` (ours), our float decode of the final latents
    within 1e-5 of the pipeline's float frames."""
    assert len(ours) == len(want)
    for i, (got, ref) in enumerate(zip(ours, want)):
        assert got.shape == ref.shape[1:] == (4, (frames - 1) // 4 + 1, HEIGHT // 16, WIDTH // 16)
        err = rel(got, ref[0])
        print(f"[parity] {label} step {i}: latents rel err {err:.2e}")
        assert err <= 1e-5
    if vae is not None:
        with torch.no_grad():
            decoded = vae.decode(vae.denormalize(ours[-1][None]))[0]  # [3, F, H, W] in [-1, 1]
        floats = (decoded / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).numpy()
        err = float(np.abs(floats - video).max())
        print(f"[parity] {label} decoded float frames max abs err {err:.2e}")
        assert err <= 1e-5
    video = np.round(video * 255).astype(np.int16)
    got = np.frombuffer(data, dtype=np.uint8).reshape(frames, HEIGHT, WIDTH, 3).astype(np.int16)
    assert got.shape == video.shape
    print(f"[parity] {label} frames max diff {np.abs(got - video).max()} levels")
    assert np.abs(got - video).max() <= 1


@pytest.mark.parametrize("source, guidance, steps", [((50, 37), 4.0, 3), ((20, 64), 1.0, 2)],
                         ids=["landscape_guided", "portrait_unguided"])
def test_i2v_matches_the_pipeline(checkpoint, deployment, our_vae, source, guidance, steps):
    prompt, seed, frames, fps = "the cat jumps", 3, 9, 16
    image = picture(*source, seed=1)
    with step_latents(deployment) as ours:
        data = generate(deployment, f"i2v-{source}-{guidance}", prompt, [("image", png(image))], num_frames=frames,
                        fps=fps, seed=seed, num_inference_steps=steps, guidance_scale=guidance)
    want, video = reference(checkpoint, prompt, frames, steps, guidance, seed, fps, image=image)
    compare(ours, want, data, video, frames, f"i2v {source}", our_vae)
    first = ours[0][:, 0]
    assert torch.equal(ours[-1][:, 0], first) or rel(ours[-1][:, 0], first) < 1e-5  # the condition stays put


def test_i2v_stretch_matches_the_pipeline_on_the_stretched_image(checkpoint, deployment):
    """``conditioning_resize: stretch``: the pipeline given the image already resized to the
    output size (its cover-and-crop is then the identity) gives the same clip."""
    prompt, seed, frames, fps = "a boat", 5, 5, 24
    image = picture(50, 37, seed=2)
    stretched = torch.nn.functional.interpolate(
        torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float(), size=(HEIGHT, WIDTH), mode="bilinear",
        align_corners=False, antialias=True).round().clamp(0, 255).byte()[0].permute(1, 2, 0).numpy()
    with step_latents(deployment) as ours:
        data = generate(deployment, "i2v-stretch", prompt, [("image", png(image))], num_frames=frames, fps=fps,
                        seed=seed, num_inference_steps=2, guidance_scale=2.0, conditioning_resize="stretch")
    want, video = reference(checkpoint, prompt, frames, 2, 2.0, seed, fps, image=Image.fromarray(stretched))
    compare(ours, want, data, video, frames, "i2v stretch")


def test_cover_and_stretch_resizes():
    image = picture(50, 37, seed=4)
    cover = image_pixels(image, WIDTH, HEIGHT, "cover")
    stretch = image_pixels(image, WIDTH, HEIGHT, "stretch")
    assert cover.shape == stretch.shape == (3, 1, HEIGHT, WIDTH)
    for x in (cover, stretch):  # 8-bit levels mapped to [-1, 1]
        levels = (x + 1) * 127.5
        assert torch.allclose(levels, levels.round(), atol=1e-4) and x.min() >= -1 and x.max() <= 1
    assert not torch.equal(cover, stretch)
    same = picture(WIDTH, HEIGHT, seed=5)  # an image of the output size comes through as it is
    for mode in ("cover", "stretch"):
        want = torch.from_numpy(np.array(same)).permute(2, 0, 1).float() / 127.5 - 1
        assert torch.equal(image_pixels(same, WIDTH, HEIGHT, mode)[:, 0], want)


@pytest.mark.parametrize("clip_frames, cond, frames, guidance", [(7, 2, 13, 3.0), (3, 2, 9, 1.0), (9, 1, 9, 2.0)],
                         ids=["two_latents_guided", "short_clip_padded", "one_latent"])
def test_v2v_matches_the_pipeline(checkpoint, deployment, our_vae, clip_frames, cond, frames, guidance):
    from mstar.media.video import decode_mp4

    prompt, seed, fps, steps = "the waves roll in", 11, 16, 2
    mp4 = clip_mp4(clip_frames, 40, 30)  # resized to 32x48 (bilinear) as the pipeline's VideoProcessor does
    decoded, _ = decode_mp4(mp4)
    with step_latents(deployment) as ours:
        data = generate(deployment, f"v2v-{clip_frames}-{cond}", prompt, [("video", mp4)], num_frames=frames,
                        fps=fps, seed=seed, num_inference_steps=steps, guidance_scale=guidance,
                        condition_latent_frames=cond)
    want, video = reference(checkpoint, prompt, frames, steps, guidance, seed, fps,
                            video=[Image.fromarray(f) for f in decoded],
                            condition_frame_indexes_vision=list(range(cond)))
    compare(ours, want, data, video, frames, f"v2v clip {clip_frames} cond {cond}", our_vae)


def test_conditioned_and_plain_requests_share_forwards_and_equal_solo_runs(deployment):
    """Packed with each other, conditioned and plain requests give their solo runs' latents up
    to the float rounding of the packed GEMMs (the rows' count changes the blocking), and
    frames within one level."""
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    latents: dict[str, torch.Tensor] = {}
    original = dit.run

    def run(items):
        outputs = original(items)
        latents.update({item.request_id: out.outputs["latents"].clone() for item, out in zip(items, outputs)})
        return outputs

    jobs = [("i2v", [("image", png(picture(50, 37, 1)))], 9), ("v2v", [("video", clip_mp4(5, 40, 30))], 13),
            ("t2v", [], 5)]
    common = {"seed": 4, "num_inference_steps": 2, "guidance_scale": 3.0, "condition_latent_frames": 1}
    dit.run = run
    try:
        alone = {name: generate(deployment, f"solo-{name}", "a kite", files, num_frames=n, **common)
                 for name, files, n in jobs}
        dit.forward_rows.clear()
        with held_until(dit, 2):
            batched = asyncio.run(together(deployment, jobs, common))
    finally:
        del dit.run
    assert sum(dit.forward_rows) == 3 * 2 * 2 and max(dit.forward_rows) > 2
    for (name, _, n), got in zip(jobs, batched):
        err = rel(latents[f"batch-{name}"], latents[f"solo-{name}"])
        print(f"[batch] {name}: final latents rel diff to solo {err:.1e}")
        assert err <= 1e-5
        a, b = (np.frombuffer(x, dtype=np.uint8).astype(np.int16) for x in (got, alone[name]))
        assert a.shape == b.shape == (n * HEIGHT * WIDTH * 3,) and np.abs(a - b).max() <= 1
    assert not dit.prepared and not dit.solvers and not dit.schedules


async def together(deployment, jobs, common):
    async def one(name, files, n):
        data = b""
        spec = GenerateSpec(f"batch-{name}", "a kite", files, ["video"],
                            {"height": HEIGHT, "width": WIDTH, "num_frames": n, **common})
        async for event in deployment.backend.generate(spec):
            assert not event.error, event.error
            data += event.data or b""
        return data

    return await asyncio.gather(*(one(*job) for job in jobs))


def test_an_unnamed_video_file_is_video_to_video(deployment):
    spec = GenerateSpec("sniff", "a cat", [("upload.mp4", clip_mp4(5, 32, 48))], ["video"],
                        {"height": HEIGHT, "width": WIDTH, "num_frames": 9})
    assert deployment.backend.spec.prepare_generate(spec).walk == "v2v_guided"
    spec = replace(spec, files=[("upload.png", png(picture(32, 48, 0)))])
    assert deployment.backend.spec.prepare_generate(spec).walk == "i2v_guided"


@pytest.mark.parametrize("files, kwargs, field", [
    ([("image", b"not an image")], {}, "image"),
    ([("video", b"not a video")], {}, "video"),
    ([("image", "PNG")], {"num_frames": 1}, "num_frames"),
    ([("video", "MP4")], {"num_frames": 1}, "num_frames"),
    ([("image", "PNG")], {"num_frames": 6}, "num_frames"),
    ([("video", "MP4")], {"num_frames": 9, "condition_latent_frames": 3}, "condition_latent_frames"),
    ([("video", "MP4")], {"condition_latent_frames": 0}, "condition_latent_frames"),
    ([("image", "PNG")], {"conditioning_resize": "fit"}, "conditioning_resize"),
    ([("image", "PNG"), ("image", "PNG")], {}, "image"),
])
def test_bad_conditioned_requests_name_the_field(deployment, files, kwargs, field):
    content = {"PNG": png(picture(20, 20, 0)), "MP4": clip_mp4(3, 32, 48)}
    files = [(name, content.get(data, data)) for name, data in files]
    spec = GenerateSpec("bad", "a cat", files, ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 5,
                                                            **kwargs})
    with pytest.raises(RequestError) as err:
        deployment.backend.spec.prepare_generate(spec)
    assert err.value.field == field


@pytest.fixture(scope="module")
def distilled_i2v(checkpoint, tmp_path_factory):
    from test_cosmos3_distilled import SCHEDULER, SIGMAS

    root = tmp_path_factory.mktemp("cosmos3-i2v-4step") / "ckpt"
    shutil.copytree(checkpoint.root, root)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    (root / "modular_model_index.json").write_text(json.dumps({"distilled_sigmas": SIGMAS, "is_distilled": True}))
    d = start(parse_config({"model": "cosmos3_super_i2v_4step", "model_path": str(root),
                            "max_concurrent_requests": 2, "model_kwargs": {"max_image_area": 64 * 64}}),
              in_process=True)
    yield d
    d.close()


def distilled_reference(checkpoint, prompt, image, frames, seed, fps):
    """The distilled i2v loop from diffusers' parts: the pipeline's tokenizer, conditioning
    latents (``prepare_latents``: the image encoded, frame 0 clean) and packing, the transformer's
    velocity masked on the clean frame, the stochastic scheduler on the request's generator, the
    clean frame re-anchored after each step (the distilled modular pipeline's scheduler step)."""
    from diffusers import Cosmos3OmniPipeline
    from test_cosmos3_distilled import reference_scheduler

    pipe = checkpoint.pipeline()
    ref = checkpoint.transformer
    ids, _ = pipe.tokenize_prompt(prompt, None, num_frames=frames, height=HEIGHT, width=WIDTH, fps=fps)
    generator = torch.Generator().manual_seed(seed)
    latents, *_, mask, _, _, _, _, _, _ = pipe.prepare_latents(
        image=image, num_frames=frames, height=HEIGHT, width=WIDTH, fps=fps, generator=generator, device="cpu",
        dtype=torch.float32)
    anchor = latents.clone()
    host = SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    text = Cosmos3OmniPipeline._prepare_text_segment(host, ids, device="cpu")
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        host, latents, has_image_condition=True, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps, curr=text["und_len"], device="cpu", condition_frame_indexes=[0])
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
            v = v * (1.0 - mask)
            latents = scheduler.step(v.unsqueeze(0), t, latents.unsqueeze(0), generator=generator,
                                     return_dict=False)[0].squeeze(0)
            latents = mask * anchor + (1.0 - mask) * latents
            steps.append(latents[0].clone())
    return steps


def test_distilled_i2v_matches_the_reference_loop(checkpoint, distilled_i2v):
    from test_cosmos3_distilled import SIGMAS

    prompt, seed, frames, fps = "a cat walks on the moon", 13, 9, 24
    image = picture(50, 37, seed=6)
    with step_latents(distilled_i2v) as ours:
        data = generate(distilled_i2v, "d-i2v", prompt, [("image", png(image))], num_frames=frames, fps=fps,
                        seed=seed)
    assert len(data) == frames * HEIGHT * WIDTH * 3
    want = distilled_reference(checkpoint, prompt, image, frames, seed, fps)
    assert len(ours) == len(want) == len(SIGMAS)
    for i, (got, ref) in enumerate(zip(ours, want)):
        err = rel(got, ref)
        print(f"[parity] distilled i2v step {i}: latents rel err {err:.2e}")
        assert err <= 1e-5
    assert torch.equal(ours[-1][:, 0], ours[0][:, 0])  # the image's frame re-anchored exactly


@pytest.mark.parametrize("files, kwargs, field", [([], {}, "image"), ([("image", "PNG")], {"guidance_scale": 3.0},
                                                                        "guidance_scale")])
def test_distilled_i2v_refusals_name_the_field(distilled_i2v, files, kwargs, field):
    files = [(name, png(picture(20, 20, 0))) for name, _ in files]
    spec = GenerateSpec("bad", "a cat", files, ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 5,
                                                            **kwargs})
    with pytest.raises(RequestError) as err:
        distilled_i2v.backend.spec.prepare_generate(spec)
    assert err.value.field == field
