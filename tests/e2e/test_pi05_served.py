"""Pi0.5 served: a tiny lerobot policy directory with dummy weights (``load_format: dummy``,
in-process runtime under uvicorn in a thread). ``/generate`` with ``output_modalities=["action"]``
and the SDK's ``act`` answer a ``[chunk, action_dim]`` float32 chunk equal to the eager
``sample_actions`` of the same weights, unnormalised with the checkpoint's statistics; a seed
fixes the chunk; concurrent requests share denoise forwards and equal their solo results; bad
inputs are a 400 naming the field."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from live_server import Uvicorn
from PIL import Image

from mstar.client import MStarClient, MStarError
from mstar.config import parse_config
from mstar.model.pi05.checkpoint import Pi05Checkpoint, read_embodiment
from mstar.model.pi05.model import prompt_text, resize_with_pad
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support.pi05 import write_checkpoint, write_stats

MODEL = "pi05"
STATE = [0.2, -1.0, 3.0, 0.5]
ARM = {"state": {"mean": [0.0, 1.0, -1.0], "std": [1.0, 2.0, 0.5]},  # another robot: 3 joints in, 4 out
       "action": {"mean": [10.0, 0.0, 0.0, -5.0], "std": [2.0, 1.0, 0.1, 3.0]}}


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Uvicorn, object, object]]:
    root = tmp_path_factory.mktemp("pi05-dummy")
    write_checkpoint(root)
    write_stats(root / "arm3", ARM["state"], ARM["action"], "MEAN_STD")
    deployment = start(parse_config({
        "model": MODEL, "model_path": str(root), "load_format": "dummy", "max_concurrent_requests": 8,
        "resources": {"kv_cache": {"max_num_pages": 256, "page_size": 4}},
        "model_kwargs": {"num_inference_steps": 3, "embodiments": {"arm3": str(root / "arm3")}},
    }), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live, deployment, root
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def client(served) -> MStarClient:
    return MStarClient(served[0].url, timeout=120)


def eager(root, images: list[bytes], state: list[float], prompt: str, seed: int, embodiment=None) -> np.ndarray:
    """The chunk by the eager policy with the same dummy weights and lerobot's preprocessing."""
    ckpt = Pi05Checkpoint.locate(str(root))
    model = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=True, seed=0)
    config, embodiment = model.config, embodiment or ckpt.embodiment()
    pixels = torch.stack([resize_with_pad(torch.from_numpy(np.array(Image.open(io.BytesIO(b)).convert("RGB")))
                                          .permute(2, 0, 1).float() / 255, 16) * 2 - 1 for b in images])
    ids = torch.tensor(ckpt.tokenizer()(prompt_text(prompt, embodiment.state.normalize(torch.tensor(state)))).input_ids)
    noise = torch.randn(config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(seed))
    width = embodiment.action.width or config.action_dim
    chunk = model.sample_actions([pixels], [ids], noise[None], num_steps=3)[0, :, :width]
    return embodiment.action.unnormalize(chunk).numpy()


def test_act_equals_eager_policy(served, client: MStarClient) -> None:
    _, _, root = served
    images = [png(16, 16, 1), png(40, 24, 2)]  # the second resized with padding
    result = client.act(images=images, state=STATE, prompt="pick up the cube", seed=5)
    assert result.shape == (5, 5)
    got = result.to_numpy()
    assert np.array_equal(np.asarray(result.actions, dtype=np.float32), got)  # JSON array == base64 floats
    want = eager(root, images, STATE, "pick up the cube", 5)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    assert np.abs(got).max() > 0


def test_embodiment_picks_its_statistics(served, client: MStarClient) -> None:
    _, _, root = served
    images = [png(16, 16, 7)]
    result = client.act(images=images, state=[0.5, 1.0, -2.0], prompt="wave", seed=3, embodiment="arm3")
    assert result.shape == (5, 4)
    want = eager(root, images, [0.5, 1.0, -2.0], "wave", 3, read_embodiment(root / "arm3"))
    assert np.abs(result.to_numpy() - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    with pytest.raises(MStarError) as err:  # the default robot's 4 values are not this one's 3
        client.act(images=images, state=STATE, prompt="wave", embodiment="arm3")
    assert err.value.status == 400 and err.value.param == "state"


def test_generate_returns_array_and_shape(served) -> None:
    form = {"text": "wave", "output_modalities": '["action"]',
            "model_kwargs": json.dumps({"state": STATE, "seed": 1})}
    response = httpx.post(f"{served[0].url}/generate", data=form, files=[("files", ("a.png", png(16, 16, 3)))],
                          timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["action_shape"] == [5, 5] and body["action_dtype"] == "float32"
    assert len(body["action"]) == 5 and all(len(row) == 5 for row in body["action"])
    assert body["finish_reason"] == "stop"


def test_streamed_generate_carries_the_chunk(served, client: MStarClient) -> None:
    images = [png(16, 16, 3)]
    events = list(client.generate("wave", files=[("a.png", images[0])], output_modalities=["action"],
                                  model_kwargs={"state": STATE, "seed": 1}, stream=True))
    [action] = [e for e in events if e.modality == "action"]
    assert action.raw["action_shape"] == [5, 5]
    streamed = np.frombuffer(action.data, dtype="<f4").reshape(5, 5)
    assert np.array_equal(np.asarray(action.raw["action"], dtype=np.float32), streamed)
    whole = client.act(images=images, state=STATE, prompt="wave", seed=1).to_numpy()
    assert np.array_equal(streamed, whole)
    assert events[-1].finish_reason == "stop"


def test_seed_fixes_the_chunk(client: MStarClient) -> None:
    images = [png(16, 16, 4)]
    a = client.act(images=images, state=STATE, prompt="stack", seed=11).to_numpy()
    b = client.act(images=images, state=STATE, prompt="stack", seed=11).to_numpy()
    c = client.act(images=images, state=STATE, prompt="stack", seed=12).to_numpy()
    assert np.array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3


def test_concurrent_requests_batch_and_equal_solo(served, client: MStarClient) -> None:
    _, deployment, _ = served
    engine = deployment.runtime.workers.workers[0].engines["policy"]
    asks = [dict(images=[png(16, 16, 20 + i)] * (1 + i % 2), state=[v + i for v in STATE], prompt=f"task {i}",
                 seed=i) for i in range(4)]
    solo = [client.act(**ask).to_numpy() for ask in asks]
    before = len(engine.forward_rows)
    with ThreadPoolExecutor(4) as pool:
        together = [r.to_numpy() for r in pool.map(lambda ask: client.act(**ask), asks)]
    assert max(engine.forward_rows[before:]) > 1  # denoise steps of several requests in one forward
    for a, b in zip(solo, together, strict=True):  # the same maths; batched fp32 GEMMs may round apart
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(a).max()))
    assert engine.pool.num_used_pages == 0  # every request gave its pages back


@pytest.mark.parametrize("images, kwargs, field", [
    (3, {"state": STATE}, "files"),
    (0, {"state": STATE}, "files"),
    (1, {"state": STATE[:3]}, "state"),
    (1, {}, "state"),
    (1, {"state": STATE, "embodiment": "nope"}, "embodiment"),
    (1, {"state": STATE, "num_inference_steps": 0}, "num_inference_steps"),
])
def test_bad_input_is_400_naming_the_field(client: MStarClient, images: int, kwargs: dict, field: str) -> None:
    form = {"text": "go", "output_modalities": '["action"]', "model_kwargs": json.dumps(kwargs)}
    files = [("files", (f"{i}.png", png(16, 16, i))) for i in range(images)]
    with pytest.raises(MStarError) as err:
        client._json("POST", "/generate", data=form, files=files or None)
    assert err.value.status == 400 and err.value.param == field, err.value


def test_other_modalities_are_refused(client: MStarClient) -> None:
    with pytest.raises(MStarError) as err:
        client.generate("go", files=[("a.png", png(16, 16, 0))], output_modalities=["text"],
                        model_kwargs={"state": STATE})
    assert err.value.status == 400 and err.value.param == "output_modalities"
