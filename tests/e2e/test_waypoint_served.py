"""Waypoint served: a tiny checkpoint (written in the released layout with random weights, so the
frames are not flat), the in-process runtime under uvicorn in a thread. ``/generate`` with a seed
image and controls streams one ``video`` event per control, as the frames are made, equal to the
eager rollout of the same weights; a seed fixes the rollout; concurrent rollouts equal their solo
results and leave no state behind; bad controls are a 400 naming the field. One more deployment
checks that ``load_format: dummy`` serves without weight files."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from live_server import Uvicorn
from PIL import Image

from mstar.client import MStarClient, MStarError
from mstar.config import parse_config
from mstar.model.waypoint.checkpoint import WaypointCheckpoint
from mstar.model.waypoint.engine import control_vector
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support.waypoint import write_checkpoint

MODEL = "waypoint"
FRAME = (4, 16, 32, 3)  # one step's frames: time_upscale x height x width x RGB


def png(seed: int, width: int = 32, height: int = 16) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def controls(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"buttons": sorted({int(b) for b in rng.integers(0, 5, 2)}), "mouse": rng.normal(size=2).tolist(),
             "scroll": int(rng.integers(-1, 2))} for _ in range(n)]


def serve(config: dict):
    deployment = start(parse_config({"model": MODEL, "max_concurrent_requests": 8, **config}), in_process=True)
    return deployment, Uvicorn(create_app(deployment.backend, served_model_names=[MODEL]))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Uvicorn, object, object]]:
    root = tmp_path_factory.mktemp("waypoint")
    write_checkpoint(root)
    deployment, server = serve({"model_path": str(root), "model_kwargs": {"max_frames": 6}})
    try:
        with server as live:
            yield live, deployment, root
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def client(served) -> MStarClient:
    return MStarClient(served[0].url, timeout=120)


def rollout(client: MStarClient, image: bytes, ctrl: list[dict], seed: int) -> list[bytes]:
    events = client.generate(files=[("seed.png", image)], output_modalities=["video"],
                             model_kwargs={"controls": ctrl, "seed": seed}, stream=True)
    events = list(events)
    assert events[-1].finish_reason == "stop"
    return [e.data for e in events if e.modality == "video"]


def eager(root, image: bytes, ctrl: list[dict], seed: int) -> list[bytes]:
    world = WaypointCheckpoint.locate(str(root)).load_world(torch.device("cpu"), torch.float32)
    pixels = torch.from_numpy(np.asarray(Image.open(io.BytesIO(image)).convert("RGB"), dtype=np.float32) / 255)
    state = world.new_rollout(seed)
    world.start(state, pixels.permute(2, 0, 1))
    return [world.step(state, control_vector(c["buttons"], c["mouse"], c["scroll"], 5)).numpy().tobytes()
            for c in ctrl]


def test_frames_stream_per_control_and_equal_eager(served, client: MStarClient) -> None:
    _, _, root = served
    image, ctrl = png(1), controls(4, 2)
    got = rollout(client, image, ctrl, seed=5)
    assert [len(d) for d in got] == [int(np.prod(FRAME))] * 4  # one event per control
    assert got == eager(root, image, ctrl, 5)
    first = np.frombuffer(got[0], dtype=np.uint8).reshape(FRAME)
    assert int(first.max()) - int(first.min()) > 10


def test_seed_fixes_the_rollout(client: MStarClient) -> None:
    image, ctrl = png(3), controls(3, 4)
    a, b = rollout(client, image, ctrl, 7), rollout(client, image, ctrl, 7)
    assert a == b
    assert rollout(client, image, ctrl, 8) != a


def test_concurrent_rollouts_equal_solo_and_free_their_state(served, client: MStarClient) -> None:
    _, deployment, _ = served
    engine = deployment.runtime.workers.workers[0].engines["world"]
    asks = [(png(10 + i), controls(2 + i % 3, 20 + i), i) for i in range(5)]
    solo = [rollout(client, *ask) for ask in asks]
    with ThreadPoolExecutor(5) as pool:
        together = list(pool.map(lambda ask: rollout(client, *ask), asks))
    assert together == solo
    assert engine.rollouts == {}


@pytest.mark.parametrize("kwargs, files, field", [
    ({"controls": [{"buttons": [5]}]}, 1, "controls[0].buttons"),
    ({"controls": [{}, {"mouse": [1.0]}]}, 1, "controls[1].mouse"),
    ({"controls": [{"scroll": 2}]}, 1, "controls[0].scroll"),
    ({"controls": [{"keys": [1]}]}, 1, "model_kwargs"),  # unknown keys: by model_kwargs, as every family
    ({"controls": []}, 1, "controls"),
    ({"controls": [{}] * 7}, 1, "controls"),
    ({}, 1, "controls"),
    ({"controls": [{}]}, 0, "files"),
    ({"controls": [{}], "seed": -1}, 1, "seed"),
])
def test_bad_input_is_400_naming_the_field(client: MStarClient, kwargs: dict, files: int, field: str) -> None:
    form = {"text": "", "output_modalities": '["video"]', "model_kwargs": json.dumps(kwargs)}
    with pytest.raises(MStarError) as err:
        client._json("POST", "/generate", data=form, files=[("files", ("s.png", png(0)))] * files or None)
    assert err.value.status == 400 and err.value.param == field, err.value


def test_other_modalities_are_refused(client: MStarClient) -> None:
    with pytest.raises(MStarError) as err:
        client.generate(files=[("s.png", png(0))], output_modalities=["text"], model_kwargs={"controls": [{}]})
    assert err.value.status == 400 and err.value.param == "output_modalities"


def test_dummy_weights_serve(tmp_path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    deployment, server = serve({"model_path": str(tmp_path), "load_format": "dummy"})
    try:
        with server as live:
            got = rollout(MStarClient(live.url, timeout=120), png(1), controls(2, 1), seed=1)
        assert [len(d) for d in got] == [int(np.prod(FRAME))] * 2
    finally:
        deployment.close()
