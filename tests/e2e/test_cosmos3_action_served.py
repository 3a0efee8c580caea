"""Cosmos3's action modes behind the HTTP app on the CPU (in-process runtime under uvicorn in a
thread): a tiny ``cosmos3_droid`` deployment with ``load_format: dummy`` (the policy layout's
configs and tokenizer, action heads, no weight files). ``/generate`` answers a policy's and inverse
dynamics' action arrays of the declared ``[action_chunk_size, raw_action_dim]`` shape (JSON and
NDJSON), forward dynamics' frames; bad ``domain_name``, ``raw_action_dim``, ``action_chunk_size``
and a missing observation are 400s naming the field; concurrent requests equal their solo runs.
The released configs carry the policy defaults."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from live_server import Uvicorn
from PIL import Image

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app

pytest.importorskip("diffusers")

MODEL = "cosmos3_droid"
CHUNK = 8
ROOT = Path(__file__).parents[2]


def write_tiny_policy(root: Path) -> Path:
    """The model tests' tiny action checkpoint layout, with its weight files removed."""
    path = ROOT / "tests" / "model" / "cosmos3" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_cosmos3_tiny_policy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer

    tok = module.tokenizer()
    module.write_checkpoint(root, Cosmos3OmniTransformer(vocab_size=len(tok), **module.ACTION_TOWER),
                            AutoencoderKLWan(**module.VAE), tok)
    for weights in root.glob("*/*.safetensors"):
        weights.unlink()
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    root = write_tiny_policy(tmp_path_factory.mktemp("cosmos3-droid-tiny"))
    knobs = {"num_inference_steps": 2, "guidance_scale": 3.0, "domain_name": "droid_lerobot",
             "action_chunk_size": CHUNK, "max_action_chunk_size": 16}
    deployment = start(parse_config({"model": MODEL, "model_path": str(root), "load_format": "dummy",
                                     "max_concurrent_requests": 4, "model_kwargs": knobs}), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def mp4(frames: int, width: int, height: int) -> bytes:
    from mstar.media.video import encode_mp4

    rng = np.random.default_rng(frames)
    return encode_mp4(rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8), fps=15)


def generate(server: Uvicorn, files: list, modalities: list[str], streaming: bool = False,
             **kwargs) -> httpx.Response:
    form = {"text": "put the cup in the sink", "output_modalities": json.dumps(modalities),
            "model_kwargs": json.dumps({"resolution_tier": 256, **kwargs})}
    if streaming:
        form["streaming"] = "true"
    return httpx.post(f"{server.url}/generate", data=form, files=[("files", f) for f in files] or None,
                      timeout=300)


def actions_of(response: httpx.Response, rows: int) -> np.ndarray:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["action_shape"] == [rows, 10] and body["action_dtype"] == "float32"
    array = np.asarray(body["action"], dtype=np.float32)
    assert np.array_equal(array, np.frombuffer(base64.b64decode(body["data"]["action"]), "<f4").reshape(rows, 10))
    assert np.isfinite(array).all()
    return array


def test_policy_answers_an_action_chunk(server: Uvicorn) -> None:
    image = ("obs.png", png(64, 48, 1))
    a = actions_of(generate(server, [image], ["action"], seed=3), CHUNK)
    assert np.array_equal(actions_of(generate(server, [image], ["action"], seed=3), CHUNK), a)
    assert not np.array_equal(actions_of(generate(server, [image], ["action"], seed=4), CHUNK), a)
    short = actions_of(generate(server, [image], ["action"], seed=3, action_chunk_size=4, raw_action_dim=10), 4)
    assert short.shape == (4, 10)
    both = generate(server, [image], ["action", "video"], seed=3)  # and the predicted clip
    assert np.array_equal(actions_of(both, CHUNK), a)
    assert len(base64.b64decode(both.json()["data"]["video"])) == (CHUNK + 1) * 48 * 64 * 3


def test_streamed_policy_carries_the_chunk(server: Uvicorn) -> None:
    response = generate(server, [("obs.png", png(64, 48, 1))], ["action"], streaming=True, seed=3)
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    [action] = [line for line in lines if line.get("modality") == "action"]
    assert action["action_shape"] == [CHUNK, 10]
    whole = actions_of(generate(server, [("obs.png", png(64, 48, 1))], ["action"], seed=3), CHUNK)
    assert np.array_equal(np.asarray(action["action"], dtype=np.float32), whole)
    assert any(line.get("modality") == "progress" for line in lines)


def test_inverse_dynamics_answers_the_clip_actions(server: Uvicorn) -> None:
    clip = ("clip.mp4", mp4(CHUNK + 1, 64, 48))
    actions_of(generate(server, [clip], ["action"], action_mode="inverse_dynamics", seed=1), CHUNK)


def test_forward_dynamics_answers_frames(server: Uvicorn) -> None:
    actions = [[0.1 * i] * 10 for i in range(3)]
    response = generate(server, [("obs.png", png(64, 48, 2))], ["video"], action_mode="forward_dynamics",
                        raw_actions=actions, seed=1)
    assert response.status_code == 200, response.text
    frames = base64.b64decode(response.json()["data"]["video"])
    assert len(frames) == (CHUNK + 1) * 48 * 64 * 3  # the content's size: 64x48 fits the 256 canvas unscaled


@pytest.mark.parametrize("files, modalities, kwargs, field", [
    ([], ["action"], {}, "image"),
    (["image"], ["action"], {"domain_name": "mars_rover"}, "domain_name"),
    (["image"], ["action"], {"raw_action_dim": 7}, "raw_action_dim"),
    (["image"], ["action"], {"raw_action_dim": 0}, "raw_action_dim"),
    (["image"], ["action"], {"action_chunk_size": 0}, "action_chunk_size"),
    (["image"], ["action"], {"action_chunk_size": 32}, "action_chunk_size"),  # over max_action_chunk_size
    (["image"], ["action"], {"action_mode": "inverse_dynamics"}, "video"),
    (["image"], ["video"], {"action_mode": "forward_dynamics"}, "raw_actions"),
    (["image"], ["action"], {"action_mode": "teleport"}, "action_mode"),
])
def test_bad_requests_are_400_naming_the_field(server: Uvicorn, files, modalities, kwargs, field) -> None:
    response = generate(server, [("obs.png", png(64, 48, 0)) for _ in files], modalities, **kwargs)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


def test_concurrent_requests_equal_their_solo_results(server: Uvicorn) -> None:
    jobs = [([("obs.png", png(64, 48, 5))], {"seed": 1}),
            ([("obs.png", png(48, 64, 6))], {"seed": 2, "action_chunk_size": 4}),
            ([("clip.mp4", mp4(CHUNK + 1, 64, 48))], {"seed": 3, "action_mode": "inverse_dynamics"}),
            ([("obs.png", png(64, 48, 5))], {"seed": 4, "guidance_scale": 1.0})]
    rows = [kw.get("action_chunk_size", CHUNK) for _, kw in jobs]
    solo = [actions_of(generate(server, files, ["action"], **kw), n) for (files, kw), n in zip(jobs, rows)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: generate(server, job[0], ["action"], **job[1]), jobs))
    for alone, response, n in zip(solo, together, rows):
        got = actions_of(response, n)
        assert np.abs(got - alone).max() <= 1e-5 * max(1.0, float(np.abs(alone).max()))


@pytest.mark.parametrize("name", ["cosmos3_droid", "cosmos3_edge_droid"])
def test_released_configs_carry_the_policy_defaults(name: str) -> None:
    from mstar.model.cosmos3.knobs import Cosmos3Knobs

    config = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    assert config["model"] == name
    knobs = Cosmos3Knobs(**config["model_kwargs"])
    assert (knobs.num_inference_steps, knobs.guidance_scale, knobs.domain_name) == (4, 3.0, "droid_lerobot")
    assert parse_config(config).model == name


def post_video(server: Uvicorn, **body) -> httpx.Response:
    image = "data:image/png;base64," + base64.b64encode(png(64, 48, 2)).decode()
    return httpx.post(f"{server.url}/v1/videos/generations",
                      json={"model": MODEL, "prompt": "push the block", "image": image, "seed": 1,
                            "action_mode": "forward_dynamics", "raw_actions": [[0.2] * 10] * 2,
                            "resolution_tier": 256, **body}, timeout=300)


def test_forward_dynamics_on_the_video_route(server: Uvicorn) -> None:
    from mstar.media.video import decode_mp4

    response = post_video(server, size="64x48", num_frames=CHUNK + 1)
    assert response.status_code == 200, response.text
    frames, _ = decode_mp4(base64.b64decode(response.json()["data"][0]["b64_json"]))
    assert frames.shape == (CHUNK + 1, 48, 64, 3)
    short = post_video(server, size="64x48", num_frames=5, action_chunk_size=4)
    assert short.status_code == 200, short.text


@pytest.mark.parametrize("body, field", [
    ({"size": "128x96", "num_frames": CHUNK + 1}, "size"),
    ({"size": "64x48"}, "num_frames"),  # the route's default length is not the chunk's
    ({"size": "64x48", "num_frames": CHUNK + 1, "domain_name": "nowhere"}, "domain_name"),
    ({"size": "64x48", "num_frames": CHUNK + 1, "raw_actions": [[0.0] * 3]}, "raw_actions"),
])
def test_video_route_refusals_name_the_field(server: Uvicorn, body: dict, field: str) -> None:
    response = post_video(server, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


def test_generate_ws_action_loop(server: Uvicorn) -> None:
    """One socket, pipelined observations: each append (an observation image) is one policy
    request of the session; its chunk comes back in order, equal to the same request on
    /generate."""
    from websockets.sync.client import connect

    observations = [png(64, 48, 30 + i) for i in range(3)]
    with connect(server.url.replace("http", "ws") + "/generate/ws") as ws:
        ws.send(json.dumps({"text": "put the cup in the sink", "output_modalities": "action",
                            "model_kwargs": {"resolution_tier": 256, "seed": 5}}))
        for image in observations:
            ws.send(json.dumps({"type": "append", "media": [base64.b64encode(image).decode()]}))
        ws.send(json.dumps({"type": "end_input"}))
        messages: list = []
        while not messages or not isinstance(messages[-1], dict) or messages[-1].get("type") != "done":
            raw = ws.recv(timeout=120)
            messages.append(raw if isinstance(raw, bytes) else json.loads(raw))
    chunks = [np.frombuffer(m, "<f4").reshape(CHUNK, 10) for m in messages if isinstance(m, bytes)]
    headers = [m for m in messages if isinstance(m, dict) and m.get("type") == "output"]
    assert [h["append"] for h in headers] == [0, 1, 2] and {h["modality"] for h in headers} == {"action"}
    assert messages[-1]["appends"] == 3
    for image, chunk in zip(observations, chunks, strict=True):
        assert np.array_equal(chunk, actions_of(generate(server, [("obs.png", image)], ["action"], seed=5), CHUNK))
