"""BAGEL's generation side through the HTTP server on the CPU: a tiny checkpoint in the hub
snapshot's layout (``tests/support/bagel_reference.py``, plus a tiny ``ae.safetensors``) loaded
with its weights (coverage both ways), the in-process runtime under uvicorn in a thread, and the
official ``openai`` client's ``images.generate`` and ``images.edit``, and ``/generate`` with
``output_modalities=["image"]``: seeds honoured, concurrent requests equal to solo, bad input
a 400 naming the field."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from live_server import Uvicorn
from PIL import Image

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app

MODEL = "bagel"
STEPS = 4  # schedule points: three Euler steps

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    from safetensors.torch import save_file

    from tests.support import bagel_reference as br

    # a latent position table of 24 x 24 tokens: images up to 384 pixels a side (the server's least is 256)
    model = br.reference_bagel(bagel=dict(br.BAGEL, max_latent_size=24))
    checkpoint = br.write_checkpoint(tmp_path_factory.mktemp("bagel"), model)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_latent_size": 24}))
    from bagel2.modeling.autoencoder import AutoEncoder, AutoEncoderParams

    torch.manual_seed(0)
    ae = AutoEncoder(AutoEncoderParams(resolution=32, in_channels=3, downsample=8, ch=32, out_ch=3,
                                       ch_mult=[1, 1, 1, 1], num_res_blocks=1, z_channels=br.VAE.z_channels,
                                       scale_factor=0.3611, shift_factor=0.1159))
    br.randomize(ae, 1)
    save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, str(checkpoint / "ae.safetensors"))
    deployment = start(parse_config({
        "model": MODEL, "model_path": str(checkpoint), "max_seq_len": 256, "max_concurrent_requests": 4,
        "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}},
        # the tiny tower reads up to 8 x 8 patches of 4 pixels
        "model_kwargs": {"seed": 3, "vit_resize": [32, 16], "vae_resize": [64, 32], "generator_kv_pages": 64},
    }), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(item) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(item.b64_json))) as image:
        assert image.format == "PNG"
        return np.asarray(image)


def generate(oai: openai.OpenAI, prompt: str, size: str = "320x256", **extra):
    result = oai.images.generate(model=MODEL, prompt=prompt, size=size, response_format="b64_json",
                                 extra_body={"num_inference_steps": STEPS, **extra})
    return [pixels(item) for item in result.data]


def edit(oai: openai.OpenAI, prompt: str, upload: bytes, **extra):
    result = oai.images.edit(model=MODEL, image=("in.png", upload, "image/png"), prompt=prompt,
                             extra_body={"num_inference_steps": STEPS, **extra})
    return [pixels(item) for item in result.data]


def test_generate_seeds_and_sizes(oai: openai.OpenAI) -> None:
    a, b = generate(oai, "a red cube", n=2, seed=4)
    assert a.shape == (256, 320, 3) and not np.array_equal(a, b)  # seeds 4 and 5
    (again,) = generate(oai, "a red cube", seed=4)
    assert np.abs(again.astype(int) - a.astype(int)).max() <= 1
    (other,) = generate(oai, "a blue sphere", seed=4)
    assert not np.array_equal(other, a)  # the prompt conditions the image
    (tall,) = generate(oai, "a red cube", size="256x384", seed=4)
    assert tall.shape == (384, 256, 3)


def test_edit_keeps_the_input_size(oai: openai.OpenAI) -> None:
    (out,) = edit(oai, "make it red", png(40, 28, seed=1), seed=2)
    assert out.shape == (32, 48, 3)  # 40x28 -> BAGEL's resize (sides multiples of 16, short side >= 32)
    (other,) = edit(oai, "make it red", png(40, 28, seed=7), seed=2)
    assert not np.array_equal(out, other)  # the input image conditions the output


def test_concurrent_requests_equal_solo(oai: openai.OpenAI) -> None:
    jobs = [lambda: generate(oai, "a red cube", seed=11)[0], lambda: generate(oai, "a cat", size="256x256", seed=12)[0],
            lambda: edit(oai, "make it red", png(40, 28, seed=1), seed=13)[0],
            lambda: generate(oai, "a cat", size="256x256", seed=12, guidance_scale=2.0)[0]]
    alone = [job() for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: job(), jobs))
    for solo, batched in zip(alone, together):
        assert np.abs(solo.astype(int) - batched.astype(int)).max() <= 1


def test_sdk_and_generate_endpoint(server: Uvicorn, tmp_path) -> None:
    from mstar.client import MStarClient

    path = tmp_path / "in.png"
    path.write_bytes(png(40, 28, seed=3))
    kwargs = {"seed": 2, "num_inference_steps": STEPS}
    with MStarClient(server.url, timeout=120) as client:
        made = client.generate_image("a cat", width=256, height=320, **kwargs)
        edited = client.edit_image("make it snowy", str(path), **kwargs)
    with Image.open(io.BytesIO(made)) as a, Image.open(io.BytesIO(edited)) as b:
        assert a.size == (256, 320) and b.size == (48, 32)
    response = httpx.post(f"{server.url}/generate", timeout=120, data={
        "text": "make it snowy", "output_modalities": "image", "model_kwargs": json.dumps(kwargs),
    }, files=[("files", ("in.png", path.read_bytes(), "image/png"))])
    assert response.status_code == 200, response.text
    assert base64.b64decode(response.json()["data"]["image"]) == edited  # the same edit, the same seed


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(size="264x256"), "size"), (dict(size="400x256"), "size"),
    (dict(extra_body={"num_inference_steps": 1}), "num_inference_steps"),
])
def test_bad_requests_are_400_naming_the_field(oai: openai.OpenAI, kwargs: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.generate(model=MODEL, prompt="a cat", **{"size": "256x256", **kwargs})
    assert err.value.body["param"] == field, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.edit(model=MODEL, image=[("a.png", png(32, 32), "image/png"), ("b.png", png(32, 32), "image/png")],
                        prompt="x")
    assert err.value.body["param"] == "image"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"cfg_renorm_type": "norm"}, "cfg_renorm_type"), ({"cfg_interval": [0.9, 0.1]}, "cfg_interval"),
    ({"cfg_scale": 2.0}, "model_kwargs"),
])
def test_bad_generate_options_are_400_naming_the_field(server: Uvicorn, kwargs: dict, field: str) -> None:
    response = httpx.post(f"{server.url}/generate", timeout=120, data={
        "text": "a cat", "output_modalities": "image", "model_kwargs": json.dumps({"width": 256, "height": 256,
                                                                                  **kwargs})})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
