"""Cosmos3 behind the HTTP app on the CPU (in-process runtime under uvicorn in a thread), a tiny
deployment with ``load_format: dummy`` (the released layout's configs and tokenizer, no weight
files): the official ``openai`` client's ``images.generate`` answers an image of the asked
size, ``/v1/videos/generations`` an mp4 of the asked size and frame count, seeds are honoured,
and bad sizes and frame counts are 400s naming the body's field. Conditioned clips: ``image``
(both resizes) and ``video`` on /v1/videos/generations, an image or mp4 file on /generate,
``input_reference`` on /v1/videos; bad images, clips, frame counts and knobs are 400s naming
the field."""

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
    ({"enable_sound": True}, "enable_sound"),  # this checkpoint has no sound pathway
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


def png_b64(width: int, height: int) -> str:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def clip(frames: int = 5) -> bytes:
    from mstar.media.video import encode_mp4

    rng = np.random.default_rng(frames)
    return encode_mp4(rng.integers(0, 256, (frames, 30, 40, 3), dtype=np.uint8), fps=8)


def frames_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    [item] = response.json()["data"]
    return decode_mp4(base64.b64decode(item["b64_json"]))[0]


def test_image_and_video_conditioned_clips(http: httpx.Client) -> None:
    """i2v (``image``, both resizes) and v2v (``video``) through /v1/videos/generations: mp4s of
    the asked size and length, each differing from the text-only clip of the same seed."""
    plain = frames_of(post(http, num_frames=9))
    image = png_b64(50, 37)
    cover = frames_of(post(http, num_frames=9, image=image))
    stretch = frames_of(post(http, num_frames=9, image=image, conditioning_resize="stretch"))
    video = frames_of(post(http, num_frames=9, video=base64.b64encode(clip()).decode(), condition_latent_frames=1))
    for frames in (cover, stretch, video):
        assert frames.shape == (9, HEIGHT, WIDTH, 3)
        assert not np.array_equal(frames, plain)
    assert not np.array_equal(cover, stretch)
    assert np.array_equal(frames_of(post(http, num_frames=9, image=image)), cover)  # seeded


def test_generate_takes_a_clip_file(server: Uvicorn) -> None:
    """/generate's multipart ``files``: an mp4 makes it video-to-video, a PNG image-to-video."""
    import json

    kwargs = {"width": WIDTH, "height": HEIGHT, "num_frames": 9, "seed": 1}
    for name, data, kind in (("clip.mp4", clip(), "video/mp4"),
                             ("start.png", base64.b64decode(png_b64(20, 20).split(",")[1]), "image/png")):
        response = httpx.post(f"{server.url}/generate", timeout=120,
                              data={"text": "a cat walks", "output_modalities": "video",
                                    "model_kwargs": json.dumps(kwargs)},
                              files=[("files", (name, data, kind))])
        assert response.status_code == 200, response.text
        assert response.json()["data"]["video"], response.text


@pytest.mark.parametrize("body, field", [
    ({"image": "data:image/png;base64,bm90IGFuIGltYWdl"}, "image"),
    ({"video": base64.b64encode(b"not a video").decode()}, "video"),
    ({"image": "PNG", "num_frames": 1}, "num_frames"),
    ({"image": "PNG", "conditioning_resize": "fit"}, "conditioning_resize"),
    ({"video": "MP4", "condition_latent_frames": 3}, "condition_latent_frames"),
    ({"video": "MP4", "image": "PNG"}, "video"),
])
def test_bad_conditioning_is_400_naming_the_field(http: httpx.Client, body: dict, field: str) -> None:
    media = {"PNG": png_b64(20, 20), "MP4": base64.b64encode(clip()).decode()}
    body = {k: media.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    response = post(http, **({"num_frames": 9} | body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


def test_video_job_with_an_input_reference(oai: openai.OpenAI) -> None:
    """/v1/videos' ``input_reference`` image makes the job image-to-video."""
    start_png = base64.b64decode(png_b64(40, 30).split(",")[1])
    video = oai.videos.create_and_poll(model=MODEL, prompt="a cat walks", size=f"{WIDTH}x{HEIGHT}",
                                       input_reference=("start.png", start_png, "image/png"),
                                       extra_body={"num_frames": 5, "seed": 1}, poll_interval_ms=20)
    assert video.status == "completed", video.error
    frames, _ = decode_mp4(oai.videos.download_content(video.id).read())
    assert frames.shape == (5, HEIGHT, WIDTH, 3)
    stretched = oai.videos.create_and_poll(model=MODEL, prompt="a cat walks", size=f"{WIDTH}x{HEIGHT}",
                                           input_reference=("start.png", start_png, "image/png"),
                                           extra_body={"num_frames": 5, "seed": 1, "conditioning_resize": "stretch"},
                                           poll_interval_ms=20)
    assert stretched.status == "completed", stretched.error
    assert not np.array_equal(decode_mp4(oai.videos.download_content(stretched.id).read())[0], frames)
    with pytest.raises(openai.BadRequestError) as err:  # a clip is /v1/videos/generations' field, not this route's
        oai.videos.create(model=MODEL, prompt="x", size=f"{WIDTH}x{HEIGHT}", extra_body={"video": "AAAA"})
    assert err.value.body["param"] == "video"


def test_nano_refuses_chat_naming_the_model(oai: openai.OpenAI) -> None:
    """Only Edge has a reasoner: a chat to Nano is a 400 naming the model."""
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert err.value.body["param"] == "model" and MODEL in err.value.body["message"]
