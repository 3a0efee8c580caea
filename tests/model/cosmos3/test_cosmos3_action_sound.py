"""Cosmos3's action modes with sound (``enable_sound`` beside an action mode) through the
in-process runtime, on a tiny random checkpoint with both pathways (action heads, a ``sound_gen``
tower and a ``sound_tokenizer/``), against diffusers 0.42.1 ``Cosmos3OmniPipeline(action=...,
enable_sound=True)`` with the same observation, weights, prompt, seed and steps: every step's
video, sound and action latents within 1e-5, the actions and the waveform within 1e-5, the frames
within one level and the PCM the clip's length. The rows pack video, sound, then actions, and each
pathway keeps its own UniPC state. On a checkpoint without the sound pathway ``enable_sound`` is a
400 naming it."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.runtime.launch import start
from tests.support.cosmos3_media import generate_action as generate
from tests.support.cosmos3_media import picture, png
from tests.support.cosmos3_sound import SOUND, add_sound_tower
from tests.support.packing import held_until

pytest.importorskip("diffusers")

CHUNK = 8
STEPS = 3
KEYS = ("latents", "sound_latents", "action_latents")


@pytest.fixture(scope="module")
def both(action_checkpoint, tmp_path_factory):
    """The action checkpoint with a ``sound_gen`` tower (``sound_dim`` 4 at 100 latents a second)
    and a ``sound_tokenizer/``: ``(root, reference pipeline class factory)``."""
    root = tmp_path_factory.mktemp("cosmos3-droid-sound") / "ckpt"
    tower, sound = add_sound_tower(action_checkpoint, root, 11)

    def pipeline():
        from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

        cls = type("Recorded", (Cosmos3OmniPipeline,), {"_callback_tensor_inputs": list(KEYS)})
        scheduler = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
        pipe = cls(transformer=tower, text_tokenizer=action_checkpoint.tokenizer, vae=action_checkpoint.vae,
                   scheduler=UniPCMultistepScheduler.from_config(scheduler), sound_tokenizer=sound,
                   enable_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return root, pipeline


@pytest.fixture(scope="module")
def deployment(both):
    root, _ = both
    d = start(parse_config({"model": "cosmos3_droid", "model_path": str(root), "max_concurrent_requests": 4,
                            "model_kwargs": {"num_inference_steps": STEPS, "guidance_scale": 3.0,
                                             "domain_name": "droid_lerobot", "action_chunk_size": CHUNK}}),
              in_process=True)
    yield d
    d.close()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def engine(d, node):
    return d.runtime.workers.workers[0].engines[node]


@contextmanager
def recorded(d, node, *keys):
    """What ``node`` writes under each of ``keys`` (in order, over the requests)."""
    target = engine(d, node)
    seen: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    original = target.run

    def run(items):
        outputs = original(items)
        for out in outputs:
            for key in keys:
                if key in out.outputs:
                    seen[key].append(out.outputs[key].clone())
        return outputs

    target.run = run
    try:
        yield seen
    finally:
        del target.run


@pytest.mark.parametrize("mode, modalities, guidance, fps", [
    ("policy", ["action", "video", "audio"], 3.0, 16),
    ("forward_dynamics", ["video", "audio"], 1.0, 24),
], ids=["policy_guided", "forward_dynamics_unguided"])
def test_actions_with_sound_match_the_pipeline(both, deployment, mode, modalities, guidance, fps):
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    _, pipeline = both
    prompt, seed = "pick up the red cup", 4
    image = picture(64, 48, seed=1)
    raw = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))
    extra = {"raw_actions": raw.tolist()} if mode == "forward_dynamics" else {}
    with recorded(deployment, "dit", *KEYS) as dit, recorded(deployment, "sound", "waveform") as sound:
        out = generate(deployment, f"{mode}-sound", prompt, [("image", png(image))], modalities, action_mode=mode,
                       seed=seed, fps=fps, guidance_scale=guidance, enable_sound=True, **extra)
    [wave] = sound["waveform"]

    want: dict[str, list[torch.Tensor]] = {key: [] for key in KEYS}

    def record(pipe, i, t, kwargs):
        for key in KEYS:
            want[key].append(kwargs[key].clone())
        return {}

    condition = dict(raw_actions=raw) if mode == "forward_dynamics" else {}
    ref = pipeline()(prompt=prompt, negative_prompt="",
                     action=CosmosActionCondition(mode=mode, chunk_size=CHUNK, domain_name="droid_lerobot",
                                                  resolution_tier=256, image=image, **condition),
                     fps=float(fps), num_inference_steps=STEPS, guidance_scale=guidance,
                     generator=torch.Generator().manual_seed(seed), output_type="np", enable_sound=True,
                     callback_on_step_end=record, callback_on_step_end_tensor_inputs=list(KEYS))
    samples = int((CHUNK + 1) / fps * SOUND["sampling_rate"])
    for key in KEYS:
        assert len(dit[key]) == len(want[key]) == STEPS, key
    for i in range(STEPS):
        assert dit["sound_latents"][i].shape == want["sound_latents"][i].shape == (4, -(-samples // 12))
        errors = {key: rel(dit[key][i], want[key][i][0] if key == "latents" else want[key][i]) for key in KEYS}
        print(f"[parity] {mode} with sound step {i}: " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        assert max(errors.values()) <= 1e-5, errors
    assert wave.shape == ref.sound.shape
    print(f"[parity] {mode} with sound: waveform {rel(wave, ref.sound):.1e}")
    assert rel(wave, ref.sound) <= 1e-5
    if mode == "policy":
        got = torch.from_numpy(np.frombuffer(out["action"], dtype="<f4").reshape(CHUNK, 10).copy())
        print(f"[parity] policy with sound: actions {rel(got, ref.action[0].float()):.1e}")
        assert rel(got, ref.action[0].float()) <= 1e-5
    else:
        assert "action" not in out and ref.action is None
    video = np.round(np.asarray(ref.video) * 255).astype(np.int16)
    frames = np.frombuffer(out["video"], dtype=np.uint8).reshape(video.shape).astype(np.int16)
    assert np.abs(frames - video).max() <= 1
    pcm = np.frombuffer(out["audio"], dtype="<i2").reshape(-1, 2)
    assert pcm.shape == (samples, 2)  # cut to the chunk + 1 frame clip's length
    want_pcm = np.round(ref.sound[:, :samples].clamp(-1, 1).numpy().T * 32767)
    assert np.abs(pcm - want_pcm).max() <= 1
    dit_engine = engine(deployment, "dit")
    assert not dit_engine.solvers and not dit_engine.sound_solvers and not dit_engine.action_solvers


def test_sound_and_plain_action_requests_packed_equal_their_solo_runs(deployment):
    image = png(picture(64, 48, seed=2))
    kwargs = dict(seed=5, num_inference_steps=2)
    alone = generate(deployment, "solo-policy-sound", "stack the blocks", [("image", image)], ["action", "audio"],
                     enable_sound=True, **kwargs)
    dit = engine(deployment, "dit")
    dit.forward_rows.clear()

    async def together():
        async def one(rid, sound):
            data: dict[str, bytes] = {}
            spec = GenerateSpec(rid, "stack the blocks", [("image", image)], ["action", "audio"] if sound else
                                ["action"], {"resolution_tier": 256, "enable_sound": sound, **kwargs})
            async for event in deployment.backend.generate(spec):
                assert not event.error, event.error
                data[event.modality] = data.get(event.modality, b"") + (event.data or b"")
            return data

        return await asyncio.gather(one("packed-policy-sound", True), one("packed-policy-plain", False))

    with held_until(dit, 2):
        with_sound, plain = asyncio.run(together())
    assert max(dit.forward_rows) == 4  # both guided pairs in one forward
    got, want = (torch.from_numpy(np.frombuffer(d["action"], dtype="<f4").copy()) for d in (with_sound, alone))
    assert rel(got, want) <= 1e-5
    pcm_got, pcm_want = (np.frombuffer(d["audio"], dtype="<i2").astype(np.int32) for d in (with_sound, alone))
    assert pcm_got.shape == pcm_want.shape and np.abs(pcm_got - pcm_want).max() <= 1
    assert "audio" not in plain and plain["action"]
    assert not dit.prepared and not dit.solvers and not dit.sound_solvers and not dit.action_solvers


def test_enable_sound_with_actions_refused_without_the_pathway(action_checkpoint):
    d = start(parse_config({"model": "cosmos3_droid", "model_path": str(action_checkpoint.root),
                            "model_kwargs": {"domain_name": "droid_lerobot", "action_chunk_size": CHUNK}}),
              in_process=True)
    try:
        spec = GenerateSpec("bad", "pick it up", [("image", png(picture(64, 48, seed=1)))], ["action"],
                            {"resolution_tier": 256, "enable_sound": True})
        with pytest.raises(RequestError) as err:
            d.backend.spec.prepare_generate(spec)
        assert err.value.field == "enable_sound"
    finally:
        d.close()
