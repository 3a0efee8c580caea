"""LTX-2.5 through the in-process runtime (Gemma 4 + connectors node, the distilled denoise Loop
over both streams, the video and audio decoder nodes) on the tiny diffusers-layout checkpoint,
against diffusers' ``LTX2Pipeline`` with the same weights, prompt and seed: the frames within one
uint8 level, the 48 kHz stereo audio within 1e-4 (plus 16-bit rounding). Also: three concurrent
requests equal their solo runs, ``video`` alone skips the audio decode, and bad sizes get errors
naming the field."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.model.ltx2_5.denoise import DISTILLED_SIGMAS
from mstar.runtime.launch import start
from tests.model.ltx2_5.conftest import PROMPT_TOKENS
from tests.support.packing import held_until

HEIGHT, WIDTH, FRAMES, SEED = 64, 96, 9, 3
PROMPT = "a cat walks on the moon"


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = start(parse_config({"model": "ltx2_5", "model_path": str(checkpoint.root), "max_concurrent_requests": 2,
                            "model_kwargs": {"max_prompt_tokens": PROMPT_TOKENS}}), in_process=True)
    yield d
    d.close()


async def collect(d, request_id, modalities=("video", "audio"), **kwargs):
    out = {"video": b"", "audio": b""}
    options = {"height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "seed": SEED, **kwargs}
    async for event in d.backend.generate(GenerateSpec(request_id, PROMPT, [], list(modalities), options)):
        assert not event.error, event.error
        if event.data:
            out[event.modality] += event.data
    return out


def generate(d, request_id, modalities=("video", "audio"), **kwargs):
    return asyncio.run(collect(d, request_id, modalities, **kwargs))


def test_walk_matches_the_pipeline(deployment, checkpoint):
    out = generate(deployment, "r1")
    frames = np.frombuffer(out["video"], np.uint8).reshape(FRAMES, HEIGHT, WIDTH, 3).astype(np.int16)
    audio = np.frombuffer(out["audio"], "<i2").reshape(-1, 2).T.astype(np.float64) / 32767
    with torch.no_grad():
        want_frames, want_audio = checkpoint.pipeline()(
            PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, frame_rate=24.0,
            num_inference_steps=len(DISTILLED_SIGMAS), sigmas=list(DISTILLED_SIGMAS), guidance_scale=1.0,
            stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=1.0, audio_stg_scale=0.0,
            audio_modality_scale=1.0, max_sequence_length=PROMPT_TOKENS,
            generator=torch.Generator().manual_seed(SEED), output_type="np", return_dict=False)
    want_u8 = np.round(np.asarray(want_frames[0]) * 255).astype(np.int16)
    levels = np.abs(frames - want_u8).max()
    err_audio = np.abs(audio - want_audio[0].float().numpy()).max()
    print(f"[parity] walk vs LTX2Pipeline: frames {levels} uint8 levels, audio max abs {err_audio:.2e} "
          f"({audio.shape[1]} samples a channel at 48 kHz)")
    assert frames.std() > 1  # not a flat image
    assert levels <= 1
    assert audio.shape == tuple(want_audio[0].shape) and err_audio <= 1e-4 + 0.5 / 32767


def test_concurrent_requests_equal_their_solo_runs(deployment):
    """Three requests sharing DiT forwards equal their solo runs (up to the rounding of a
    batched matrix product: one uint8 level, a few 16-bit audio levels)."""
    seeds = (11, 12, 13)
    solo = [generate(deployment, f"solo-{s}", seed=s) for s in seeds]

    async def together():
        return await asyncio.gather(*(collect(deployment, f"together-{s}", seed=s) for s in seeds))

    dit = deployment.runtime.workers.workers[0].engines["dit"]
    before = len(dit.forward_rows)
    with held_until(dit, 2):
        joint = asyncio.run(together())
    rows = list(dit.forward_rows)[before:]
    print("[batch] forward rows", rows)
    assert sum(rows) == 3 * len(DISTILLED_SIGMAS) and max(rows) > 1
    for alone, both in zip(solo, joint):
        for modality, dtype, tol in (("video", np.uint8, 1), ("audio", "<i2", 4)):
            a, b = (np.frombuffer(x[modality], dtype).astype(np.int32) for x in (alone, both))
            assert a.shape == b.shape and np.abs(a - b).max() <= tol, modality
    assert solo[0]["video"] != solo[1]["video"]
    assert not dit.sigmas  # per-request state released


def test_video_alone_skips_the_audio_decode(deployment):
    out = generate(deployment, "r2", modalities=("video",))
    assert len(out["video"]) == FRAMES * HEIGHT * WIDTH * 3 and out["audio"] == b""


@pytest.mark.parametrize("kwargs, field", [({"width": 100}, "width"), ({"num_frames": 10}, "num_frames"),
                                           ({"height": 16}, "height")])
def test_bad_sizes_name_the_field(deployment, kwargs, field):
    with pytest.raises(RequestError) as err:
        generate(deployment, f"bad-{field}", **kwargs)
    assert err.value.field == field


def test_the_video_routes_answer_an_mp4_with_its_soundtrack(deployment):
    """/v1/videos/generations on LTX-2.5: an H.264 mp4 of the asked size and frames with a 48 kHz
    stereo AAC track as long as the walk's audio; ``seconds`` rounds to LTX's 8k + 1 frames;
    a knob LTX does not take is a 400 naming it. The job route shares the same code
    (tests/e2e/test_wan22_video_jobs.py)."""
    import base64

    from fastapi.testclient import TestClient

    from mstar.media.video import decode_mp4, decode_mp4_audio
    from mstar.server.app import create_app

    body = {"prompt": PROMPT, "size": f"{WIDTH}x{HEIGHT}", "seed": SEED}
    with TestClient(create_app(deployment.backend, served_model_names=["ltx2_5"])) as http:
        response = http.post("/v1/videos/generations", json={**body, "seconds": 0.5})
        assert response.status_code == 200, response.text
        mp4 = base64.b64decode(response.json()["data"][0]["b64_json"])
        refused = http.post("/v1/videos/generations", json={**body, "num_inference_steps": 4})
    frames, fps = decode_mp4(mp4)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == 24  # 0.5 s x 24 fps -> 9 = 8 + 1 frames
    sound, rate = decode_mp4_audio(mp4)
    walk = np.frombuffer(generate(deployment, "r-mp4")["audio"], "<i2").reshape(-1, 2).T / 32767
    assert rate == 48000 and sound.shape[0] == 2
    assert walk.shape[1] <= sound.shape[1] < walk.shape[1] + 1024  # AAC pads the last 1024-sample frame
    level = np.sqrt((walk ** 2).mean())
    assert abs(np.sqrt((sound[:, :walk.shape[1]] ** 2).mean()) - level) < 0.2 * level
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "num_inference_steps", refused.text
