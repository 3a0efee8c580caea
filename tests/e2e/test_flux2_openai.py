"""FLUX.2 [klein] behind the HTTP app, served from a dummy-weight deployment on the CPU (a
tiny config in a diffusers-like folder, ``load_format: dummy``, in-process runtime under
uvicorn in a thread): the official ``openai`` client's ``images.generate`` and
``images.edit``, the SDK's ``generate_image`` / ``edit_image``, /generate with a reference
image, and a 4xx naming the rule for a size that is not a multiple of 16, an area over
``max_image_area``, a corrupt or unusable reference image and ``n`` out of range."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from live_server import Uvicorn
from PIL import Image

from mstar.client import MStarClient
from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app

MODEL = "flux2_klein"
VAE = {"block_out_channels": [8, 8, 8, 8], "down_block_types": ["DownEncoderBlock2D"] * 4,
       "up_block_types": ["UpDecoderBlock2D"] * 4, "layers_per_block": 1, "latent_channels": 4,
       "norm_num_groups": 4}  # 8x downsampling and 2x2 patches: sizes are multiples of 16, as for the real VAE
DIT = {"in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
       "num_attention_heads": 2, "joint_attention_dim": 48, "timestep_guidance_channels": 32,
       "axes_dims_rope": [4, 4, 4, 4], "guidance_embeds": False}
QWEN = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 28, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}
MAX_AREA = 256 * 320


def _qwen_tokenizer():
    path = Path(__file__).parents[1] / "model" / "test_qwen3_encoder.py"
    spec = importlib.util.spec_from_file_location("_klein_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_qwen_tokenizer()


def png(width: int, height: int, colour=(30, 120, 200)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def size_of(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        return image.size


def max_pixel_difference(a: bytes, b: bytes) -> int:
    with Image.open(io.BytesIO(a)) as x, Image.open(io.BytesIO(b)) as y:
        return int(np.abs(np.asarray(x, dtype=np.int16) - np.asarray(y, dtype=np.int16)).max())


def write_tiny_klein(root: Path) -> Path:
    """A FLUX.2 klein directory at tiny widths (configs and tokenizer; ``load_format: dummy``)."""
    from transformers import Qwen3Config

    tokenizer = _qwen_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    Qwen3Config(vocab_size=len(tokenizer), **QWEN).save_pretrained(root / "text_encoder")
    for folder, config in (("vae", VAE), ("transformer", DIT)):
        (root / folder).mkdir(parents=True)
        (root / folder / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    root = write_tiny_klein(tmp_path_factory.mktemp("klein-dummy"))
    deployment = start(parse_config({
        "model": MODEL, "model_path": str(root), "load_format": "dummy", "max_concurrent_requests": 4,
        "model_kwargs": {"max_image_area": MAX_AREA, "num_inference_steps": 1},
    }), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def decode(item) -> bytes:
    return base64.b64decode(item.b64_json)


def test_openai_generate(oai: openai.OpenAI) -> None:
    result = oai.images.generate(model=MODEL, prompt="a cat", size="256x256", n=2, response_format="b64_json",
                                 extra_body={"seed": 4})
    images = [decode(item) for item in result.data]
    assert [size_of(i) for i in images] == [(256, 256)] * 2
    assert images[0] != images[1]  # seeds 4 and 5
    again = oai.images.generate(model=MODEL, prompt="a cat", size="256x256", extra_body={"seed": 4})
    assert max_pixel_difference(decode(again.data[0]), images[0]) <= 1  # a seed fixes the image (up to the
    # rounding of the batched text-encoder and DiT matmuls: here n=2 shared a forward, there it ran alone)


def test_openai_edit(oai: openai.OpenAI) -> None:
    references = [("a.png", png(300, 260), "image/png"), ("b.png", png(256, 256, (200, 40, 40)), "image/png")]
    result = oai.images.edit(model=MODEL, image=references, prompt="make it red", extra_body={"seed": 1})
    [image] = [decode(item) for item in result.data]
    assert size_of(image) == (288, 256)  # the first reference's size, down to a multiple of 16
    one = oai.images.edit(model=MODEL, image=references[:1], prompt="make it red", size="256x256",
                          extra_body={"seed": 1})
    plain = oai.images.generate(model=MODEL, prompt="make it red", size="256x256", extra_body={"seed": 1})
    assert size_of(decode(one.data[0])) == (256, 256)
    assert decode(one.data[0]) != decode(plain.data[0])  # the reference conditions the image


@pytest.mark.parametrize("size, rule", [
    ("264x256", "multiple of 16"),
    ("320x320", "max_image_area"),
])
def test_bad_size_is_400_naming_the_rule(oai: openai.OpenAI, size: str, rule: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.generate(model=MODEL, prompt="a cat", size=size)
    assert err.value.body["param"] == "size" and rule in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.edit(model=MODEL, image=("a.png", png(256, 256), "image/png"), prompt="x", size=size)
    assert err.value.body["param"] == "size" and rule in err.value.body["message"]


@pytest.mark.parametrize("n", [0, 5])
def test_n_out_of_range_is_400(oai: openai.OpenAI, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.generate(model=MODEL, prompt="a cat", size="256x256", n=n)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.edit(model=MODEL, image=("a.png", png(256, 256), "image/png"), prompt="x", n=n)
    assert err.value.body["param"] == "n"


@pytest.mark.parametrize("upload, rule", [
    (png(256, 256)[:60], "corrupt"),  # truncated
    (b"GIF89a but not really", "not an image"),
    (png(40, 300), "at least 64"),  # the model cannot condition on it
])
def test_bad_reference_is_400_naming_image(oai: openai.OpenAI, upload: bytes, rule: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.edit(model=MODEL, image=("a.png", upload, "image/png"), prompt="x", size="256x256")
    assert err.value.body["param"] == "image" and rule in err.value.body["message"], err.value.body


def test_sdk_and_generate_edit(server: Uvicorn, tmp_path: Path) -> None:
    path = tmp_path / "in.png"
    path.write_bytes(png(256, 272))
    with MStarClient(server.url, timeout=120) as client:
        made = client.generate_image("a cat", width=256, height=256, seed=2)
        edited = client.edit_image("make it snowy", str(path), seed=2)
    assert size_of(made) == (256, 256) and size_of(edited) == (256, 272)
    response = httpx.post(f"{server.url}/generate", timeout=120, data={
        "text": "make it snowy", "output_modalities": "image", "model_kwargs": json.dumps({"seed": 2}),
    }, files=[("files", ("in.png", path.read_bytes(), "image/png"))])
    assert response.status_code == 200, response.text
    assert base64.b64decode(response.json()["data"]["image"]) == edited  # the same edit, the same seed
