"""V-JEPA 2 and 2-AC served: tiny configs with dummy weights (``load_format: dummy``, in-process
runtime under uvicorn in a thread), one server per family shared by the file's tests.

``/generate`` with ``output_modalities=["latent"]`` answers an ``.npz`` of float32 arrays
(``embeddings``, and ``predicted`` when the predictor runs) with their shapes in
``latent_arrays``; the arrays equal the eager modules' on the same weights and the same frame
preparation; concurrent requests equal their solo results; bad inputs are a 400 naming the
field.
"""

from __future__ import annotations

import base64
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

from mstar.config import parse_config
from mstar.model.vjepa2.checkpoint import VJEPA2ACCheckpoint, VJEPA2Checkpoint
from mstar.model.vjepa2.model import processor_frames, square_crop_frames
from mstar.runtime.launch import start
from mstar.server.app import create_app

HF_TINY = {"model_type": "vjepa2", "patch_size": 8, "crop_size": 32, "frames_per_clip": 4, "tubelet_size": 2,
           "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "mlp_ratio": 2.0,
           "pred_hidden_size": 32, "pred_num_attention_heads": 2, "pred_num_hidden_layers": 1,
           "pred_num_mask_tokens": 2}
AC_TINY = {"encoder": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 8,
                       "crop_size": 32},
           "predictor": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "action_dim": 7}}
CPU = torch.device("cpu")


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def serve(root, model: str) -> Iterator[tuple[str, object]]:
    deployment = start(parse_config({"model": model, "model_path": str(root), "load_format": "dummy",
                                     "max_concurrent_requests": 8, "model_kwargs": {"max_frames": 4}}),
                       in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[model])) as live:
            yield live.url, deployment
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def vjepa2(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vjepa2-dummy")
    (root / "config.json").write_text(json.dumps(HF_TINY))
    yield from serve(root, "vjepa2")


@pytest.fixture(scope="module")
def vjepa2_ac(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vjepa2-ac-dummy")
    (root / "config.json").write_text(json.dumps(AC_TINY))
    yield from serve(root, "vjepa2_ac")


def post(url: str, frames: list[bytes], kwargs: dict | None = None, modalities: str = '["latent"]',
         stream: bool = False) -> httpx.Response:
    form = {"output_modalities": modalities, "model_kwargs": json.dumps(kwargs or {})}
    if stream:
        form["streaming"] = "true"
    files = [("files", (f"{i}.png", data)) for i, data in enumerate(frames)]
    return httpx.post(f"{url}/generate", data=form, files=files or None, timeout=120)


def arrays(response: httpx.Response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    body = response.json()
    with np.load(io.BytesIO(base64.b64decode(body["data"]["latent"]))) as archive:
        out = {name: archive[name] for name in archive.files}
    assert body["latent_format"] == "npz"
    assert body["latent_arrays"] == {k: {"shape": list(v.shape), "dtype": "float32"} for k, v in out.items()}
    return out


def clip(frames: list[bytes]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.array(Image.open(io.BytesIO(f)).convert("RGB"))) for f in frames])


def close(got: np.ndarray, want: torch.Tensor) -> None:
    want = want.numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))


def test_encoder_and_predictor_equal_eager(vjepa2) -> None:
    url, deployment = vjepa2
    frames = [png(48, 40, i) for i in range(4)]  # resized to 36 on the short side, centre-cropped to 32
    model = VJEPA2Checkpoint.locate(deployment.config.model_path).load_model(CPU, torch.float32, dummy=True, seed=0)
    pixels = processor_frames(clip(frames), 32)[None]
    with torch.no_grad():
        hidden = model.encoder(pixels)
    got = arrays(post(url, frames))
    assert list(got) == ["embeddings"]
    close(got["embeddings"], hidden[0])
    target = [3, 17, 30, 5]
    got = arrays(post(url, frames, {"target_tokens": target}))
    context = torch.tensor([i for i in range(32) if i not in target])[None]
    with torch.no_grad():
        want = model.predictor(hidden, context, torch.tensor(target)[None])[0]
    close(got["embeddings"], hidden[0])
    close(got["predicted"], want)


def test_streamed_line_carries_the_shapes(vjepa2) -> None:
    url, _ = vjepa2
    response = post(url, [png(32, 32, 9)], {"target_tokens": [0, 1]}, stream=True)
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    [latent] = [line for line in lines if line["modality"] == "latent"]
    assert latent["latent_arrays"] == {"embeddings": {"shape": [16, 32], "dtype": "float32"},
                                       "predicted": {"shape": [2, 32], "dtype": "float32"}}
    assert lines[-1]["finish_reason"] == "stop"


def test_concurrent_requests_equal_solo(vjepa2) -> None:
    url, _ = vjepa2
    asks = [([png(32, 32, 40 + i)] * 2, {"target_tokens": [i, 15 - i]} if i % 2 else {}) for i in range(6)]
    solo = [arrays(post(url, *ask)) for ask in asks]
    with ThreadPoolExecutor(6) as pool:
        together = [arrays(r) for r in pool.map(lambda ask: post(url, *ask), asks)]
    for a, b in zip(solo, together, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert np.abs(a[name] - b[name]).max() <= 1e-5 * max(1.0, float(np.abs(a[name]).max()))


@pytest.mark.parametrize("frames, kwargs, field", [
    (3, {}, "files"),  # not a multiple of the tubelet
    (6, {}, "files"),  # past max_frames
    (0, {}, "files"),
    (2, {"target_tokens": [40]}, "target_tokens"),  # 2 frames: 16 tokens
    (2, {"target_tokens": [1, 1]}, "target_tokens"),
    (2, {"context_tokens": [1]}, "context_tokens"),
    (2, {"target_tokens": list(range(16))}, "target_tokens"),
    (2, {"mask": [1]}, "model_kwargs"),
])
def test_vjepa2_bad_input_is_400_naming_the_field(vjepa2, frames: int, kwargs: dict, field: str) -> None:
    response = post(vjepa2[0], [png(32, 32, i) for i in range(frames)], kwargs)
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_frames_of_different_sizes_are_refused(vjepa2) -> None:
    response = post(vjepa2[0], [png(32, 32, 0), png(40, 32, 1)])
    assert response.status_code == 400 and response.json()["error"]["param"] == "files.1", response.text
    response = post(vjepa2[0], [png(32, 32, 0)], modalities='["text"]')
    assert response.status_code == 400 and response.json()["error"]["param"] == "output_modalities"


def test_ac_encoder_and_predictor_equal_eager(vjepa2_ac) -> None:
    url, deployment = vjepa2_ac
    frames = [png(64, 40, i) for i in range(3)]  # the central 40x40 square, resized to 32
    gen = np.random.default_rng(0)
    actions, states = gen.normal(size=(3, 7)).tolist(), gen.normal(size=(3, 7)).tolist()
    ckpt = VJEPA2ACCheckpoint.locate(deployment.config.model_path)
    model = ckpt.load_model(CPU, torch.float32, dummy=True, seed=0)
    pixels = square_crop_frames(clip(frames), 32)[None]
    with torch.no_grad():
        tokens = model.encode_frames(pixels)
        want = model.predict(tokens, torch.tensor(actions)[None], torch.tensor(states)[None])
    got = arrays(post(url, frames))
    close(got["embeddings"], tokens[0])
    got = arrays(post(url, frames, {"actions": actions, "states": states}))
    close(got["embeddings"], tokens[0])
    close(got["predicted"], want[0])
    assert got["predicted"].shape == (3 * 16, 32)


def test_ac_concurrent_requests_equal_solo(vjepa2_ac) -> None:
    url, _ = vjepa2_ac
    gen = np.random.default_rng(1)
    asks = [([png(32, 32, 60 + i)] * (1 + i % 2), {"actions": gen.normal(size=(1 + i % 2, 7)).tolist(),
                                                   "states": gen.normal(size=(1 + i % 2, 7)).tolist()})
            for i in range(6)]
    solo = [arrays(post(url, *ask)) for ask in asks]
    with ThreadPoolExecutor(6) as pool:
        together = [arrays(r) for r in pool.map(lambda ask: post(url, *ask), asks)]
    for a, b in zip(solo, together, strict=True):
        for name in a:
            assert np.abs(a[name] - b[name]).max() <= 1e-5 * max(1.0, float(np.abs(a[name]).max()))


@pytest.mark.parametrize("frames, kwargs, field", [
    (2, {"actions": [[0.0] * 7] * 2}, "states"),
    (2, {"actions": [[0.0] * 6] * 2, "states": [[0.0] * 7] * 2}, "actions"),
    (2, {"actions": [[0.0] * 7] * 3, "states": [[0.0] * 7] * 2}, "actions"),
    (2, {"actions": [[0.0] * 7] * 2, "states": [[0.0] * 7]}, "states"),
    (2, {"states": [[0.0] * 7] * 2}, "states"),
    (5, {}, "files"),
    (2, {"actions": "left"}, "actions"),
])
def test_ac_bad_input_is_400_naming_the_field(vjepa2_ac, frames: int, kwargs: dict, field: str) -> None:
    response = post(vjepa2_ac[0], [png(32, 32, i) for i in range(frames)], kwargs)
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_a_video_file_is_a_clip(vjepa2) -> None:
    from mstar.media.video import decode_frames, encode_mp4

    url, deployment = vjepa2
    pixels = np.random.default_rng(5).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    mp4 = encode_mp4(pixels, fps=4)
    form = {"output_modalities": '["latent"]'}
    got = arrays(httpx.post(f"{url}/generate", data=form, files=[("files", ("clip.mp4", mp4))], timeout=120))
    model = VJEPA2Checkpoint.locate(deployment.config.model_path).load_model(CPU, torch.float32, dummy=True, seed=0)
    decoded = torch.from_numpy(decode_frames(mp4, [0, 1]))  # what the server decodes (H.264 is lossy)
    with torch.no_grad():
        close(got["embeddings"], model.encoder(processor_frames(decoded, 32)[None])[0])
    response = httpx.post(f"{url}/generate", data=form, files=[("files", ("x.bin", b"not a clip"))], timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "files.0", response.text


def test_frame_preparation_crops_where_the_recipes_say() -> None:
    """A 36x36 frame is already at the processor's short edge: its centre 32 square is cut. A
    64x40 frame in 2-AC keeps its central 40x40 square: the 12-pixel side bands never show."""
    frame = torch.randint(0, 256, (1, 36, 36, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    got = processor_frames(frame, 32)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    want = (frame[:, 2:34, 2:34].permute(0, 3, 1, 2).float() / 255 - mean.view(3, 1, 1)) / std.view(3, 1, 1)
    assert torch.allclose(got, want, atol=1e-6)
    wide = torch.zeros(1, 40, 64, 3, dtype=torch.uint8)
    wide[:, :, :12] = wide[:, :, 52:] = 255  # white bands left and right, black square in the middle
    out = square_crop_frames(wide, 32) * std.view(3, 1, 1) + mean.view(3, 1, 1)
    assert out.shape == (1, 3, 32, 32) and float(out.abs().max()) < 1e-6
    assert float(processor_frames(wide, 32).mul(std.view(3, 1, 1)).add(mean.view(3, 1, 1)).max()) < 1e-6
