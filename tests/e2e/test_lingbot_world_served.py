"""LingBot-World (``lingbot_world_1_3b``) served on the CPU: an in-process deployment of a tiny
release (the reference's ``config.json`` at the root, diffusers-layout ``text_encoder/``,
``tokenizer/`` and Wan2.1 ``vae/`` configs, ``load_format: dummy``) behind the HTTP app.
``/generate`` streams the video chunk by chunk (NDJSON lines of raw frames: 9 frames, then 12
a chunk), the camera trajectory changes the video, concurrent rollouts equal their solo runs
(seeded), bad fields (poses, frame counts, image) are 400s naming them, the video route answers
an mp4, and every rollout is released at the end. Sessions: a rollout of one chunk resumed for
two more equals one request of three bit for bit; ending a session or its eviction (the store
keeps one idle session here) leaves nothing on the worker, and its resume is a 410."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from live_server import Uvicorn
from PIL import Image

from mstar.config import parse_config
from mstar.media.video import decode_mp4
from mstar.runtime.launch import start
from mstar.server.app import create_app

MODEL = "lingbot_world_1_3b"
WIDTH = HEIGHT = 32  # latents 4 x 4: 2 x 2 DiT tokens a frame
FRAMES = 21  # 6 latent frames: two chunks of 3 (9 video frames, then 12)
UMT5 = dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu",
            dropout_rate=0.0)
DIT = dict(model_type="i2v", patch_size=[1, 2, 2], text_len=512, in_dim=36, dim=24, ffn_dim=40, freq_dim=32,
           text_dim=32, out_dim=16, num_heads=2, num_layers=2, local_attn_size=-1, sink_size=0, qk_norm=True,
           cross_attn_norm=True, eps=1e-6)
VAE = dict(_class_name="AutoencoderKLWan", base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
           attn_scales=[], temperal_downsample=[False, True, True], is_residual=False, dropout=0.0,
           latents_mean=[0.0] * 16, latents_std=[1.0] * 16)


def write_release(root):
    from transformers import UMT5Config

    from tests.support.diffusers_dirs import make_t5_tokenizer

    tokenizer = make_t5_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    (root / "text_encoder").mkdir()
    UMT5Config(vocab_size=len(tokenizer), **UMT5).save_pretrained(root / "text_encoder")
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text(json.dumps(VAE))
    (root / "config.json").write_text(json.dumps(DIT))
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple]:
    root = write_release(tmp_path_factory.mktemp("lingbot-tiny"))
    config = {"model": MODEL, "model_path": str(root), "load_format": "dummy", "max_concurrent_requests": 4,
              "session_store_size": 1, "model_kwargs": {"max_image_area": 64 * 64, "window_frames": 6}}
    deployment = start(parse_config(config), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield deployment, live
    finally:
        deployment.close()


@pytest.fixture()
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[1].url, timeout=120) as client:
        yield client


def png(seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def orbit(frames: int, step: float = 0.05) -> list:
    """Camera-to-world poses turning about y and moving forward, [F, 3, 4]."""
    poses = []
    for i in range(frames):
        a = step * i
        rot = [[np.cos(a), 0.0, np.sin(a)], [0.0, 1.0, 0.0], [-np.sin(a), 0.0, np.cos(a)]]
        poses.append([rot[r] + [0.1 * i if r == 2 else 0.0] for r in range(3)])
    return poses


def generate(http: httpx.Client, *, seed: int = 3, image: bytes | None = None, session: dict | None = None,
             **kwargs) -> httpx.Response:
    options = {"width": WIDTH, "height": HEIGHT, "num_frames": FRAMES, "seed": seed, **kwargs}
    files = [("files", ("start.png", image if image is not None else png(), "image/png"))]
    if session and session.get("resume_session"):
        files = [] if image is None else files
    data = {"text": "a cat walks on the moon", "output_modalities": '["video"]', "streaming": "true",
            "model_kwargs": json.dumps(options)}
    data |= {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in (session or {}).items()}
    return http.post("/generate", data=data, files=files or None)


def chunks_of(response: httpx.Response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    errors = [line for line in lines if "error" in line]
    assert not errors, errors
    frame = WIDTH * HEIGHT * 3
    out = []
    for line in lines:
        if line.get("modality") == "video" and line.get("data"):
            raw = np.frombuffer(base64.b64decode(line["data"]), dtype=np.uint8)
            assert raw.size % frame == 0
            out.append(raw.reshape(-1, HEIGHT, WIDTH, 3))
    return out


def test_streams_chunk_by_chunk(http):
    chunks = chunks_of(generate(http, camera_poses=orbit(FRAMES)))
    assert [len(c) for c in chunks] == [9, 12]
    video = np.concatenate(chunks)
    assert video.std() > 0  # not a blank video


def test_camera_and_seed_change_the_video(http):
    still = np.concatenate(chunks_of(generate(http)))
    moving = np.concatenate(chunks_of(generate(http, camera_poses=orbit(FRAMES, 0.3))))
    other_seed = np.concatenate(chunks_of(generate(http, seed=4)))
    assert np.array_equal(still, np.concatenate(chunks_of(generate(http))))  # seeded: the same again
    assert not np.array_equal(still, moving) and not np.array_equal(still, other_seed)
    rows_4x4 = [row + [[0.0, 0.0, 0.0, 1.0]] for row in orbit(FRAMES, 0.3)]
    assert np.array_equal(moving, np.concatenate(chunks_of(generate(http, camera_poses=rows_4x4))))


def test_concurrent_rollouts_equal_solo(http):
    bodies = [dict(seed=s, image=png(s), camera_poses=orbit(FRAMES, 0.1 * s)) for s in (1, 2, 3)]
    solo = [np.concatenate(chunks_of(generate(http, **b))) for b in bodies]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda b: np.concatenate(chunks_of(generate(http, **b))), bodies))
    for a, b in zip(solo, together):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kwargs, field", [
    ({"num_frames": 17}, "num_frames"),
    ({"width": 40}, "width"),
    ({"camera_poses": orbit(5)}, "camera_poses"),
    ({"camera_poses": [[[1.0, 0.0], [0.0, 1.0]]] * FRAMES}, "camera_poses"),
    ({"camera_poses": [[[0.0] * 4] * 3] * FRAMES}, "camera_poses"),
    ({"intrinsics": [1.0, 2.0]}, "intrinsics"),
    ({"camera_poses": "not poses"}, "camera_poses"),
])
def test_bad_fields_are_400_naming_them(http, kwargs, field):
    response = generate(http, **kwargs)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


def test_oversized_trajectory_is_400(http):
    poses = [[[0.123456789012345] * 4] * 4] * 4077  # ~1.3 MB of JSON: over the form's 1 MiB text part
    response = generate(http, camera_poses=poses)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "model_kwargs", response.text


def test_missing_image_is_400(http):
    data = {"text": "a cat", "output_modalities": '["video"]',
            "model_kwargs": json.dumps({"width": WIDTH, "height": HEIGHT, "num_frames": 9})}
    response = http.post("/generate", data=data)
    assert response.status_code == 400 and response.json()["error"]["param"] == "image", response.text


def test_video_route_answers_an_mp4(http):
    uri = "data:image/png;base64," + base64.b64encode(png()).decode()
    response = http.post("/v1/videos/generations", json={"model": MODEL, "prompt": "a cat", "seed": 1, "image": uri,
                                                         "size": f"{WIDTH}x{HEIGHT}", "num_frames": 9, "fps": 8})
    assert response.status_code == 200, response.text
    frames, rate = decode_mp4(base64.b64decode(response.json()["data"][0]["b64_json"]))
    assert frames.shape == (9, HEIGHT, WIDTH, 3) and rate == 8


def test_rollouts_are_released(served, http):
    chunks_of(generate(http))
    engine = served[0].runtime.workers.workers[0].engines["world"]
    deadline = time.monotonic() + 10
    while engine.rollouts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.rollouts


# ------------------------------------------------------------------------ sessions
def slowing(frames: int) -> list:
    """Poses turning about y and moving forward ever slower: the longest step comes first, so
    a trajectory sent in stretches is normalised as the whole one (docs/lingbot.md)."""
    poses = []
    for i in range(frames):
        a, z = 0.04 * i, 0.5 * (1 - 0.97 ** i)
        rot = [[np.cos(a), 0.0, np.sin(a)], [0.0, 1.0, 0.0], [-np.sin(a), 0.0, np.cos(a)]]
        poses.append([rot[r] + [z if r == 2 else 0.0] for r in range(3)])
    return poses


def held(deployment, expected: tuple[str, ...] = ()) -> tuple[list, dict]:
    """The sessions the worker's store holds and the engine's live rollouts, once the runtime
    is idle and the store holds ``expected`` with no rollout left. An eviction's drop travels
    to the worker with a plan sent after the evicting request ended, so the store is read
    until it settles: up to 10 s is allowed before what is still held is returned."""
    runtime = deployment.runtime
    worker = runtime.workers.workers[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
            runtime.conductor.idle and not runtime.tracked and sorted(worker.sessions.sessions) == sorted(expected)
            and not worker.engines["world"].rollouts):
        time.sleep(0.02)
    return worker.sessions.sessions, worker.engines["world"].rollouts


def test_resumed_session_equals_one_request(served, http):
    total = 33  # 9 latent frames: three chunks of 3 (9 video frames, then 12, 12)
    poses = slowing(total)
    whole = np.concatenate(chunks_of(generate(http, num_frames=total, camera_poses=poses)))
    first = chunks_of(generate(http, num_frames=9, camera_poses=poses[:9], session={"session_id": "walk"}))
    rest = chunks_of(generate(http, num_frames=24, camera_poses=poses[9:], seed=99,  # the seed is the session's
                              session={"session_id": "walk", "resume_session": True, "end_session": True}))
    assert [len(c) for c in first + rest] == [9, 12, 12]  # only the new chunks come back
    assert np.array_equal(np.concatenate(first + rest), whole)
    sessions, rollouts = held(served[0])
    assert sessions == [] and rollouts == {}
    gone = generate(http, num_frames=12, session={"session_id": "walk", "resume_session": True})
    assert gone.status_code == 410 and gone.json()["error"]["param"] == "session_id", gone.text


def test_an_evicted_session_leaves_nothing(served, http):
    chunks_of(generate(http, num_frames=9, session={"session_id": "one"}))
    assert held(served[0], ("one",)) == (["one"], {})
    chunks_of(generate(http, num_frames=9, session={"session_id": "two"}))  # the store keeps one idle session
    assert held(served[0], ("two",)) == (["two"], {})
    gone = generate(http, num_frames=12, session={"session_id": "one", "resume_session": True})
    assert gone.status_code == 410, gone.text
    chunks_of(generate(http, num_frames=12, session={"session_id": "two", "resume_session": True,
                                                     "end_session": True}))
    assert held(served[0]) == ([], {})


@pytest.mark.parametrize("kwargs, image, field", [
    ({"num_frames": 9}, False, "num_frames"),  # a resume makes whole later chunks: 12k frames
    ({"num_frames": 12}, True, "image"),  # the rollout has its start image
])
def test_bad_resumes_are_400_naming_the_field(served, http, kwargs, image, field):
    chunks_of(generate(http, num_frames=9, session={"session_id": "bad"}))
    response = generate(http, image=png() if image else None, session={"session_id": "bad", "resume_session": True},
                        **kwargs)
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    chunks_of(generate(http, num_frames=12, session={"session_id": "bad", "resume_session": True,
                                                     "end_session": True}))
    assert held(served[0]) == ([], {})
