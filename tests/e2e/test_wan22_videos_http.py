"""Wan2.2 behind the HTTP app on a tiny random checkpoint on the CPU (in-process runtime under
uvicorn in a thread): /v1/videos/generations answers an mp4 that PyAV decodes to the asked
size and frame count (or PNG frames), ``seconds`` rounds to a 4k + 1 count, bad sizes, frame
counts and images are 400s naming the body's field, and concurrent requests equal their solo
videos (compared as lossless PNG frames, within 1 per channel: the mp4 bytes are not stable)."""

from __future__ import annotations

import base64
import importlib.util
import io
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import Uvicorn
from PIL import Image

from mstar.client import MStarClient
from mstar.config import parse_config
from mstar.media.video import decode_mp4
from mstar.runtime.launch import start
from mstar.server.app import create_app
from mstar.server.video_routes import frames_for

MODEL = "wan22"
WIDTH, HEIGHT = 32, 64


def _wan_fixtures():
    path = Path(__file__).parents[1] / "model" / "wan22" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_wan22_tiny", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def write_tiny_wan(root: Path) -> Path:
    """The tiny Wan2.2 checkpoint of the model tests (seeded random weights, diffusers layout)."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.support.diffusers_dirs import randomize, write_diffusers_dir

    wan = _wan_fixtures()
    tokenizer = wan.make_t5_tokenizer()
    dit = WanTransformer3DModel(**wan.DIT).eval()
    vae = AutoencoderKLWan(**wan.VAE).eval()
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **wan.UMT5)).eval()
    for seed, module in enumerate((dit, vae, text)):
        randomize(module, seed, gains=("gamma",))
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.3)
    write_diffusers_dir(root, transformer=dit, vae=vae, text_encoder=text, tokenizer=tokenizer,
                        scheduler=wan.SCHEDULER, model_index=wan.MODEL_INDEX)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    root = write_tiny_wan(tmp_path_factory.mktemp("wan22-tiny"))
    knobs = {"max_video_pixels": 64 * 64 * 9, "max_image_area": 64 * 64, "num_inference_steps": 2}
    deployment = start(parse_config({"model": MODEL, "model_path": str(root), "max_concurrent_requests": 4,
                                     "model_kwargs": knobs}), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (30, 120, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def post(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/videos/generations", json={"model": MODEL, "prompt": "a cat walks", "seed": 3,
                                                     "size": f"{WIDTH}x{HEIGHT}", **body})


def mp4_of(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    [item] = response.json()["data"]
    return base64.b64decode(item["b64_json"])


def test_frames_for_rounds_to_4k_plus_1() -> None:
    assert [frames_for(s, 24) for s in (0.01, 0.2, 1, 3.375)] == [1, 5, 25, 81]
    assert frames_for(1, 8) == 9 and frames_for(0.75, 8) == 5  # 6 frames: 5 is nearer than 9


def test_mp4_has_the_size_and_frames(http: httpx.Client) -> None:
    frames, rate = decode_mp4(mp4_of(post(http, num_frames=9, fps=8)))
    assert frames.shape == (9, HEIGHT, WIDTH, 3) and rate == 8
    frames, _ = decode_mp4(mp4_of(post(http, seconds=0.5, fps=8)))  # 4 frames -> 5
    assert frames.shape[0] == 5


def test_png_frames_and_image_to_video(http: httpx.Client) -> None:
    response = post(http, num_frames=5, response_format="png_frames")
    assert response.status_code == 200, response.text
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in response.json()["data"]]
    assert [i.size for i in images] == [(WIDTH, HEIGHT)] * 5
    uri = "data:image/png;base64," + base64.b64encode(png(40, 50)).decode()
    i2v = post(http, num_frames=5, image=uri, response_format="png_frames")
    assert i2v.status_code == 200, i2v.text
    assert i2v.json()["data"] != response.json()["data"]  # the image conditions the video


@pytest.mark.parametrize("body, field", [
    ({"size": "33x64"}, "size"),
    ({"size": "wide"}, "size"),
    ({"size": "64x64", "num_frames": 9, "seed": 1, "guidance_scale": 1.0, "fps": 8,
      "negative_prompt": "x", "num_inference_steps": 1, "image": None, "seconds": None}, None),
    ({"num_frames": 6}, "num_frames"),
    ({"seconds": 100.0, "num_frames": None}, "seconds"),  # 2401 frames: over max_video_pixels
    ({"num_frames": 5, "seconds": 1.0}, "num_frames"),
    ({"image": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}, "image"),
    ({"response_format": "url"}, "response_format"),
    ({"video": "AAAA"}, "video"), ({"conditioning_resize": "stretch"}, "conditioning_resize"),  # Cosmos3's
])
def test_bad_fields_are_400_naming_them(http: httpx.Client, body: dict, field: str | None) -> None:
    response = post(http, **({"num_frames": 5} | body))
    if field is None:  # the control: every field at a valid value
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


def raw_frames(http: httpx.Client, seed: int) -> np.ndarray:
    response = post(http, num_frames=5, seed=seed, response_format="png_frames")
    assert response.status_code == 200, response.text
    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))))
                     for d in response.json()["data"]])


def test_concurrent_videos_equal_solo(http: httpx.Client) -> None:
    seeds = (1, 2, 3)
    solo = [raw_frames(http, s) for s in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:
        together = list(pool.map(lambda s: raw_frames(http, s), seeds))
    for a, b in zip(solo, together, strict=True):  # up to the rounding of batched DiT matmuls, as in the
        assert np.abs(a.astype(np.int16) - b).max() <= 1  # model tests: a batch of 3 is not 3 forwards of 1
    assert not np.array_equal(solo[0], solo[1])


def test_a_seed_fixes_the_frames(http: httpx.Client) -> None:
    """Equal requests give equal frames (within 1, see above); the mp4 bytes are not compared:
    PyAV 18.1's x264 at crf 18 wrote different streams for the same tiny frames (32x64 and
    64x128; 128x256 and up were stable in our tries), so equality is checked on the frames."""
    first, again = (raw_frames(http, 4) for _ in range(2))
    assert np.abs(first.astype(np.int16) - again).max() <= 1
    video, _ = decode_mp4(mp4_of(post(http, num_frames=5, seed=4)))
    assert video.shape == first.shape
    assert np.abs(video.astype(np.int16) - first).mean() < 20  # lossy, but the same video


def test_sdk_generate_video(server: Uvicorn, tmp_path: Path) -> None:
    with MStarClient(server.url, timeout=120) as client:
        video = client.generate_video("a cat walks", width=WIDTH, height=HEIGHT, num_frames=5, fps=8, seed=2,
                                      image=png(40, 50))
    frames, rate = decode_mp4(video.save(tmp_path / "cat.mp4").read_bytes())
    assert frames.shape == (5, HEIGHT, WIDTH, 3) and rate == 8


def test_generate_streams_progress_then_the_video(server: Uvicorn) -> None:
    """/generate's NDJSON: one progress line a denoising step, in order, before the frames."""
    kwargs = {"width": WIDTH, "height": HEIGHT, "num_frames": 5, "num_inference_steps": 3, "seed": 1}
    with MStarClient(server.url, timeout=120) as client:
        events = list(client.generate("a cat walks", output_modalities=["video"], model_kwargs=kwargs, stream=True))
    progress = [e.progress for e in events if e.modality == "progress"]
    assert progress == [(1, 3), (2, 3), (3, 3)]
    kinds = [e.modality for e in events if e.data is not None or e.progress is not None]
    assert kinds == ["progress"] * 3 + ["video"]
    video = b"".join(e.data for e in events if e.modality == "video" and e.data)
    assert len(video) == 5 * HEIGHT * WIDTH * 3
    assert events[-1].finish_reason == "stop"
