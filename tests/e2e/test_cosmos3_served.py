"""Cosmos3 behind the HTTP app on the CPU (in-process runtime under uvicorn in a thread), a tiny
deployment with ``load_format: dummy`` (the released layout's configs and tokenizer, no weight
files): the official ``openai`` client's ``images.generate`` answers an image of the asked
size, ``/v1/videos/generations`` an mp4 of the asked size and frame count, seeds are honoured,
and bad sizes and frame counts are 400s naming the body's field."""

from __future__ import annotations

import base64
import importlib.util
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from live_server import Uvicorn
from PIL import Image

from mstar.config import parse_config
from mstar.media.video import decode_mp4
from mstar.runtime.launch import start
from mstar.server.app import create_app

pytest.importorskip("diffusers")

MODEL = "cosmos3"
WIDTH, HEIGHT = 32, 48


def write_tiny_cosmos3(root: Path) -> Path:
    """The model tests' tiny checkpoint layout, with its weight files removed."""
    path = Path(__file__).parents[1] / "model" / "cosmos3" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_cosmos3_tiny", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer

    tok = module.tokenizer()
    module.write_checkpoint(root, Cosmos3OmniTransformer(vocab_size=len(tok), **module.TOWER),
                            AutoencoderKLWan(**module.VAE), tok)
    for weights in root.glob("*/*.safetensors"):
        weights.unlink()
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    root = write_tiny_cosmos3(tmp_path_factory.mktemp("cosmos3-tiny"))
    knobs = {"max_video_pixels": 64 * 64 * 9, "max_image_area": 256 * 256, "num_inference_steps": 2}
    deployment = start(parse_config({"model": MODEL, "model_path": str(root), "load_format": "dummy",
                                     "max_concurrent_requests": 4, "model_kwargs": knobs}), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def image(oai: openai.OpenAI, seed: int, prompt: str = "a red cube") -> np.ndarray:
    result = oai.images.generate(model=MODEL, prompt=prompt, size="256x256", response_format="b64_json",
                                 extra_body={"seed": seed})
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))


def test_images_generate(oai: openai.OpenAI) -> None:
    a = image(oai, 1)
    assert a.shape == (256, 256, 3)  # the images route's smallest side
    assert np.array_equal(image(oai, 1), a)
    assert not np.array_equal(image(oai, 2), a)


def post(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/videos/generations", json={"model": MODEL, "prompt": "a cat walks", "seed": 3,
                                                     "size": f"{WIDTH}x{HEIGHT}", **body})


def test_video_mp4_has_the_size_and_frames(http: httpx.Client) -> None:
    response = post(http, num_frames=9, fps=8)
    assert response.status_code == 200, response.text
    [item] = response.json()["data"]
    frames, rate = decode_mp4(base64.b64decode(item["b64_json"]))
    assert frames.shape == (9, HEIGHT, WIDTH, 3) and rate == 8


@pytest.mark.parametrize("body, field", [
    ({"size": "40x48"}, "size"), ({"size": "32x8"}, "size"), ({"num_frames": 6}, "num_frames"),
    ({"num_frames": 13, "size": "64x64"}, "num_frames"), ({"size": "32x48", "num_frames": 5}, None),
])
def test_bad_video_fields_are_400_naming_them(http: httpx.Client, body: dict, field: str | None) -> None:
    response = post(http, **({"num_frames": 5} | body))
    if field is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


@pytest.mark.parametrize("size", ["264x256", "512x512"])  # not 16k; over max_image_area
def test_bad_image_sizes_are_400_naming_size(oai: openai.OpenAI, size: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.generate(model=MODEL, prompt="a red cube", size=size, response_format="b64_json")
    assert err.value.body["param"] == "size"


def test_video_job_api(oai: openai.OpenAI) -> None:
    """OpenAI's job API (/v1/videos): create, poll, download an mp4; the family's rules are 400s
    before a job exists."""
    video = oai.videos.create_and_poll(model=MODEL, prompt="a cat walks", size=f"{WIDTH}x{HEIGHT}",
                                       extra_body={"num_frames": 5, "fps": 8, "seed": 1}, poll_interval_ms=20)
    assert video.status == "completed", video.error
    frames, rate = decode_mp4(oai.videos.download_content(video.id).read())
    assert frames.shape == (5, HEIGHT, WIDTH, 3) and rate == 8
    for size, extra, field in (("40x48", {"num_frames": 5}, "size"), (f"{WIDTH}x{HEIGHT}", {"num_frames": 6},
                                                                       "num_frames")):
        with pytest.raises(openai.BadRequestError) as err:
            oai.videos.create(model=MODEL, prompt="x", size=size, extra_body=extra)
        assert err.value.body["param"] == field
    assert not [v for v in oai.videos.list() if v.status == "failed"]
