"""/v1/images/generations, /v1/images/edits and /generate image output over a fake
imaging backend: the official OpenAI client, every validation error naming its field,
hostile uploads, backend errors, cancellation on disconnect, and the SDK's
``generate_image`` / ``edit_image``."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from mstar.client import MStarClient, MStarError
from mstar.contract import ImageSpec, RequestError
from mstar.server import image_routes
from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer, wait_until


class FakeImager(FakeBackend):
    """The echoing fake plus ``generate_images``: ``n`` solid-colour PNGs of the requested
    size (the colour follows the seed). Prompt ``bad`` raises RequestError (422),
    ``forever`` never finishes. Records specs and cancellations."""

    tasks = FakeBackend.tasks | {"image_generation", "image_edit"}

    def __init__(self) -> None:
        super().__init__()
        self.image_specs: list[ImageSpec] = []
        self.image_cancelled: list[str] = []

    async def generate_images(self, spec: ImageSpec) -> list[bytes]:
        self.image_specs.append(spec)
        if spec.prompt == "bad":
            raise RequestError("prompt", "the fake backend rejects this prompt", 422)
        try:
            if spec.prompt == "forever":
                await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.image_cancelled.append(spec.prompt)
            raise
        colour = ((spec.seed or 0) % 256, 100, 200)
        return [png(spec.width, spec.height, colour) for _ in range(spec.n)]


def png(width: int, height: int, colour: tuple = (10, 20, 30), fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format=fmt)
    return buffer.getvalue()


def bomb() -> bytes:
    """A valid, tiny PNG whose header claims 100000x100000 pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def size_of(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        return image.size


@pytest.fixture(scope="module")
def imager() -> FakeImager:
    return FakeImager()


@pytest.fixture(scope="module")
def live(imager: FakeImager) -> Iterator[LiveServer]:
    with LiveServer(create_app(imager, served_model_names=[MODEL])) as server:
        yield server


@pytest.fixture(scope="module")
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sdk(live: LiveServer) -> Iterator[MStarClient]:
    with MStarClient(live.url, timeout=10) as client:
        yield client


def post_error(url: str, expected_status: int = 400, **kwargs: Any) -> str | None:
    """POST, expect an OpenAI error body with ``expected_status``; its ``param``."""
    response = httpx.post(url, timeout=10, **kwargs)
    assert response.status_code == expected_status, response.text
    error = response.json()["error"]
    assert error["message"]
    if error["param"]:
        assert error["message"].startswith(error["param"])
    return error["param"]


# ---------------------------------------------------------------------- generations


def test_openai_generate(oai: openai.OpenAI, imager: FakeImager) -> None:
    result = oai.images.generate(
        model=MODEL, prompt="a red fox", size="512x512", n=2, response_format="b64_json",
        extra_body={"seed": 3, "num_inference_steps": 4, "guidance_scale": 3.5},
    )
    assert result.created > 0 and len(result.data) == 2
    for item in result.data:
        assert item.b64_json and size_of(base64.b64decode(item.b64_json)) == (512, 512)
    spec = imager.image_specs[-1]
    assert (spec.prompt, spec.width, spec.height, spec.n) == ("a red fox", 512, 512, 2)
    assert (spec.seed, spec.num_inference_steps, spec.guidance_scale) == (3, 4, 3.5)
    assert spec.images == [] and spec.request_id.startswith("img-")


def test_generate_defaults(live: LiveServer, imager: FakeImager) -> None:
    body = {"prompt": "x", "quality": "standard", "style": "vivid", "user": "u1"}
    response = httpx.post(f"{live.url}/v1/images/generations", json=body, timeout=10)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert len(data) == 1 and size_of(base64.b64decode(data[0]["b64_json"])) == (1024, 1024)
    spec = imager.image_specs[-1]
    assert (spec.n, spec.seed, spec.num_inference_steps, spec.guidance_scale) == (1, None, None, None)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x" * 4001}, "prompt"),
        ({"prompt": "x", "size": "12x12"}, "size"),
        ({"prompt": "x", "size": "abc"}, "size"),
        ({"prompt": "x", "size": "1000x1000"}, "size"),
        ({"prompt": "x", "n": 9}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "quality": "hd"}, "quality"),
        ({"prompt": "x", "style": "natural"}, "style"),
        ({"prompt": "x", "output_format": "gif"}, "output_format"),
        ({"prompt": "x", "output_compression": 50}, "output_compression"),
        ({"prompt": "x", "output_format": "png", "output_compression": 50}, "output_compression"),
        ({"prompt": "x", "output_format": "jpeg", "output_compression": 101}, "output_compression"),
        ({"prompt": "x", "output_format": "webp", "output_compression": -1}, "output_compression"),
        ({"prompt": "x", "seed": "abc"}, "seed"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x", "num_inference_steps": 101}, "num_inference_steps"),
        ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ],
)
def test_generate_errors(live: LiveServer, body: dict, param: str) -> None:
    assert post_error(f"{live.url}/v1/images/generations", json=body) == param


def test_output_format_and_compression_reach_the_backend(live: LiveServer, imager: FakeImager) -> None:
    """OpenAI's output_format (png, jpeg, webp) and output_compression (jpeg and webp) travel
    to the backend in the spec's model_kwargs and are echoed in the response; png stays the
    default. Edits and /generate take them too (the latter in model_kwargs)."""
    url = f"{live.url}/v1/images/generations"
    body = httpx.post(url, json={"prompt": "x", "output_format": "jpeg", "output_compression": 80}, timeout=10).json()
    assert body["output_format"] == "jpeg"
    assert imager.image_specs[-1].model_kwargs == {"output_format": "jpeg", "output_compression": 80}
    assert httpx.post(url, json={"prompt": "x"}, timeout=10).json()["output_format"] == "png"
    assert imager.image_specs[-1].model_kwargs == {}
    form = {"prompt": "x", "output_format": "webp", "output_compression": "0"}
    files = {"image": ("a.png", png(64, 64), "image/png")}
    edited = httpx.post(f"{live.url}/v1/images/edits", data=form, files=files, timeout=10)
    assert edited.json()["output_format"] == "webp"
    assert imager.image_specs[-1].model_kwargs == {"output_format": "webp", "output_compression": 0}
    kwargs = '{"output_format": "png", "output_compression": 5}'
    form = {"text": "x", "output_modalities": '["image"]', "model_kwargs": kwargs}
    assert post_error(f"{live.url}/generate", data=form) == "model_kwargs.output_compression"


def test_response_format_url_says_why(live: LiveServer) -> None:
    body = {"prompt": "x", "response_format": "url"}
    response = httpx.post(f"{live.url}/v1/images/generations", json=body, timeout=10)
    assert "does not host files" in response.json()["error"]["message"]


def test_generate_other_errors(live: LiveServer, imager: FakeImager) -> None:
    url = f"{live.url}/v1/images/generations"
    headers = {"content-type": "application/json"}
    assert post_error(url, content=b"{nope", headers=headers) == "body"
    assert post_error(url, content=b"[1]", headers=headers) == "body"
    assert post_error(url, 404, json={"prompt": "x", "model": "dall-e-3"}) == "model"
    assert post_error(url, 422, json={"prompt": "bad"}) == "prompt"  # from the backend


def test_openai_error_surfaces(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.images.generate(model=MODEL, prompt="x", n=9)
    assert "n" == info.value.body["param"]  # type: ignore[index]


def test_disconnect_cancels(live: LiveServer, imager: FakeImager) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/images/generations", json={"prompt": "forever"}, timeout=0.5)
    assert wait_until(lambda: "forever" in imager.image_cancelled)


# ---------------------------------------------------------------------------- edits


def test_openai_edit(oai: openai.OpenAI, imager: FakeImager, tmp_path: Path) -> None:
    first, second = tmp_path / "a.png", tmp_path / "b.jpg"
    first.write_bytes(png(500, 300))
    second.write_bytes(png(64, 64, fmt="JPEG"))
    with first.open("rb") as a, second.open("rb") as b:
        result = oai.images.edit(model=MODEL, image=[a, b], prompt="make it blue", n=1,
                                 extra_body={"seed": 5})
    assert len(result.data) == 1
    assert size_of(base64.b64decode(result.data[0].b64_json or "")) == (496, 288)
    spec = imager.image_specs[-1]
    assert spec.images == [first.read_bytes(), second.read_bytes()]
    assert (spec.prompt, spec.width, spec.height, spec.seed) == ("make it blue", 496, 288, 5)
    assert spec.request_id.startswith("imgedit-")

    with first.open("rb") as a:
        result = oai.images.edit(image=a, prompt="p", size="256x512", n=2)
    assert [size_of(base64.b64decode(d.b64_json or "")) for d in result.data] == [(256, 512)] * 2


def test_edit_form_fields(live: LiveServer, imager: FakeImager) -> None:
    data = {"prompt": "p", "n": "2", "num_inference_steps": "7", "guidance_scale": "1.5",
            "seed": "11", "size": "auto", "response_format": "b64_json"}
    response = httpx.post(f"{live.url}/v1/images/edits", data=data,
                          files={"image": ("x.png", png(300, 300))}, timeout=10)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2
    spec = imager.image_specs[-1]
    assert (spec.n, spec.num_inference_steps, spec.guidance_scale, spec.seed) == (2, 7, 1.5, 11)
    assert (spec.width, spec.height) == (288, 288)


def _edit(files: list[tuple[str, tuple[str, bytes]]], **data: str) -> dict[str, Any]:
    return {"data": {"prompt": "p", **data}, "files": files}


@pytest.mark.parametrize(
    "request_kwargs, status, param",
    [
        (_edit([("image", ("c.png", png(300, 300)[:120]))]), 400, "image"),  # corrupt
        (_edit([("image", ("e.png", b""))]), 400, "image"),  # empty
        (_edit([("image", ("b.png", bomb()))]), 400, "image"),  # decompression bomb
        (_edit([("image", ("t.txt", b"hello, world"))]), 400, "image"),  # not an image
        (_edit([("image[]", ("x.png", png(8, 8)))] * 5), 400, "image"),  # too many
        (_edit([("other", ("x.png", png(8, 8)))]), 400, "image"),  # none
        (_edit([("image", ("x.png", png(8, 8)))], size="12x12"), 400, "size"),
        (_edit([("image", ("x.png", png(8, 8)))], size="abc"), 400, "size"),
        (_edit([("image", ("x.png", png(8, 8)))], n="9"), 400, "n"),
        (_edit([("image", ("x.png", png(8, 8)))], n="two"), 400, "n"),
        (_edit([("image", ("x.png", png(8, 8)))], response_format="url"), 400, "response_format"),
        (_edit([("image", ("x.png", png(8, 8)))], prompt=""), 400, "prompt"),
        (_edit([("image", ("x.png", png(8, 8))), ("mask", ("m.png", png(8, 8)))]), 400, "mask"),
        (_edit([("image", ("x.png", png(8, 8)))], model="nope"), 404, "model"),
        (_edit([("image", ("x.png", png(8, 8)))], prompt="bad"), 422, "prompt"),
        ({"json": {"prompt": "p"}}, 400, "image"),  # not multipart
    ],
)
def test_edit_errors(live: LiveServer, request_kwargs: dict, status: int, param: str) -> None:
    assert post_error(f"{live.url}/v1/images/edits", status, **request_kwargs) == param


def test_edit_upload_cap(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_routes, "MAX_UPLOAD_BYTES", 1000)  # the server runs in-process
    big = png(256, 256, fmt="BMP")  # ~196 KB
    kwargs = _edit([("image", ("big.bmp", big))])
    assert post_error(f"{live.url}/v1/images/edits", 413, **kwargs) == "image"


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_edit_image_url_fields(live: LiveServer, imager: FakeImager) -> None:
    """Uploads and ``image_url`` references, in form order; a urlencoded form may carry only
    references."""
    first, second, third = png(64, 64), png(96, 32), png(32, 32, (1, 2, 3))
    parts = [("image_url", (None, data_uri(second))), ("image", ("a.png", first)),  # no filename: a text field
             ("image_url", (None, base64.b64encode(third).decode()))]
    response = httpx.post(f"{live.url}/v1/images/edits", data={"prompt": "p"}, files=parts, timeout=10)
    assert response.status_code == 200, response.text
    assert imager.image_specs[-1].images == [second, first, third]
    response = httpx.post(f"{live.url}/v1/images/edits", data={"prompt": "p", "image_url": data_uri(second)},
                          timeout=10)
    assert response.status_code == 200, response.text
    assert imager.image_specs[-1].images == [second]


@pytest.mark.parametrize(
    "fields, files, status, param, rule",
    [
        ({"image_url": ["https://example.com/a.png"]}, None, 400, "image_url.0", "MSTAR_ALLOW_REMOTE=1"),
        ({"image_url": [data_uri(png(8, 8)), "/etc/passwd"]}, None, 400, "image_url.1", "paths on the server"),
        ({"image_url": ["data:image/png;base64,abcde"]}, None, 400, "image_url.0", "invalid base64"),
        ({"image_url": [data_uri(b"not an image")]}, None, 400, "image", "image"),
        ({"image_url": [data_uri(png(8, 8))] * 3}, [("image", ("a.png", png(8, 8)))] * 2, 400, "image",
         "at most 4 images"),
        ({}, [("image_url", ("a.png", png(8, 8)))], 400, "image_url.0", "not a file"),
    ],
)
def test_edit_image_url_errors(live: LiveServer, imager: FakeImager, monkeypatch: pytest.MonkeyPatch,
                               fields: dict, files: list | None, status: int, param: str, rule: str) -> None:
    monkeypatch.delenv("MSTAR_ALLOW_REMOTE", raising=False)
    seen = len(imager.image_specs)
    response = httpx.post(f"{live.url}/v1/images/edits", data={"prompt": "p", **fields}, files=files, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and rule in error["message"], error
    assert len(imager.image_specs) == seen


def test_edit_image_url_capped(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_routes, "MAX_UPLOAD_BYTES", 1000)
    big = data_uri(png(256, 256, fmt="BMP"))
    assert post_error(f"{live.url}/v1/images/edits", 413, data={"prompt": "p", "image_url": big}) == "image_url.0"


def test_edit_body_streamed_past_the_cap_is_refused(imager: FakeImager, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Content-Length to check up front: the byte counter stops the body as it arrives,
    before any image in it is decoded."""
    monkeypatch.setattr(image_routes, "MAX_UPLOAD_BYTES", 1000)
    monkeypatch.setattr(image_routes, "_FORM_OVERHEAD", 1000)
    decoded: list[bytes] = []
    monkeypatch.setattr(image_routes, "decode_image", lambda data, **kwargs: decoded.append(data))
    seen = len(imager.image_specs)

    def chunks() -> Iterator[bytes]:
        yield b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\np\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
        for _ in range(8):
            yield b"x" * 1024

    with LiveServer(create_app(imager)) as server:
        response = httpx.post(f"{server.url}/v1/images/edits", content=chunks(), timeout=30,
                              headers={"content-type": "multipart/form-data; boundary=b"})
    assert response.status_code == 413 and response.json()["error"]["param"] == "image", response.text
    assert "over the limit" in response.json()["error"]["message"]
    assert decoded == [] and len(imager.image_specs) == seen


def test_openai_edit_error(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.images.edit(image=("bomb.png", bomb(), "image/png"), prompt="p")
    assert info.value.body["param"] == "image"  # type: ignore[index]


# -------------------------------------------------------------------------------- SDK


def test_sdk_generate_image(sdk: MStarClient, imager: FakeImager) -> None:
    image = sdk.generate_image("a cat", width=768, height=512, seed=9, num_inference_steps=3,
                               guidance_scale=0.0, model=MODEL)
    assert isinstance(image, bytes) and size_of(image) == (768, 512)
    spec = imager.image_specs[-1]
    assert (spec.seed, spec.num_inference_steps, spec.guidance_scale) == (9, 3, 0.0)
    several = sdk.generate_image("cats", n=3, width=256, height=256)
    assert isinstance(several, list) and [size_of(i) for i in several] == [(256, 256)] * 3
    with pytest.raises(MStarError) as info:
        sdk.generate_image("a cat", width=1000)
    assert info.value.status == 400 and info.value.param == "size"


def test_sdk_edit_image(sdk: MStarClient, imager: FakeImager, tmp_path: Path) -> None:
    path = tmp_path / "ref.png"
    path.write_bytes(png(640, 480))
    image = sdk.edit_image("snow", path, images=[png(300, 300)], seed=1)
    assert isinstance(image, bytes) and size_of(image) == (640, 480)
    spec = imager.image_specs[-1]
    assert spec.images == [path.read_bytes(), png(300, 300)] and spec.seed == 1
    resized = sdk.edit_image("snow", path.read_bytes(), width=256, height=256, n=2)
    assert isinstance(resized, list) and [size_of(i) for i in resized] == [(256, 256)] * 2
    with pytest.raises(ValueError):
        sdk.edit_image("snow", path, width=256)
    with pytest.raises(ValueError):
        sdk.edit_image("snow", path, images=[path] * 4)
    with pytest.raises(MStarError) as info:
        sdk.edit_image("snow", b"garbage")
    assert info.value.param == "image"


# -------------------------------------------------------------------------- /generate


def _generate_form(text: str, streaming: bool = False, **kwargs: Any) -> dict[str, str]:
    return {"text": text, "output_modalities": '["image"]',
            "streaming": "true" if streaming else "false", "model_kwargs": json.dumps(kwargs)}


def test_generate_image_json(live: LiveServer, imager: FakeImager) -> None:
    form = _generate_form("a boat", width=512, height=256, seed=4, num_inference_steps=2,
                          guidance_scale=1.0, style="ink")
    response = httpx.post(f"{live.url}/generate", data=form, timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["finish_reason"] == "stop" and body["request_id"].startswith("gen-")
    assert size_of(base64.b64decode(body["data"]["image"])) == (512, 256)
    spec = imager.image_specs[-1]
    assert (spec.prompt, spec.seed, spec.num_inference_steps, spec.guidance_scale) == ("a boat", 4, 2, 1.0)
    assert spec.model_kwargs == {"style": "ink"} and spec.request_id == body["request_id"]

    form = _generate_form("boats", n=2, width=256, height=256)
    images = httpx.post(f"{live.url}/generate", data=form, timeout=10).json()["data"]["image"]
    assert isinstance(images, list) and len(images) == 2


def test_generate_image_with_reference(live: LiveServer, imager: FakeImager) -> None:
    files = [("files", ("ref.png", png(333, 333)))]
    response = httpx.post(f"{live.url}/generate", data=_generate_form("redo"), files=files, timeout=10)
    assert response.status_code == 200, response.text
    assert size_of(base64.b64decode(response.json()["data"]["image"])) == (320, 320)
    assert imager.image_specs[-1].images == [png(333, 333)]


def test_generate_image_ndjson(live: LiveServer) -> None:
    form = _generate_form("ships", streaming=True, n=2, width=256, height=256)
    response = httpx.post(f"{live.url}/generate", data=form, timeout=10)
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    assert [line["modality"] for line in lines] == ["image", "image"]
    assert [line["finish_reason"] for line in lines] == [None, "stop"] and "usage" in lines[-1]
    assert all(size_of(base64.b64decode(line["data"])) == (256, 256) for line in lines)


@pytest.mark.parametrize(
    "form, files, status, param",
    [
        (_generate_form("x", width=1000), None, 400, "model_kwargs.width"),
        (_generate_form("x", height="tall"), None, 400, "model_kwargs.height"),
        (_generate_form("x", n=5), None, 400, "model_kwargs.n"),
        (_generate_form("x", num_inference_steps=0), None, 400, "model_kwargs.num_inference_steps"),
        (_generate_form(""), None, 400, "text"),
        (_generate_form("x"), [("files", ("b.png", bomb()))], 400, "files"),
        ({**_generate_form("x"), "output_modalities": "text,image"}, None, 400, "output_modalities"),
        (_generate_form("bad"), None, 422, "prompt"),
    ],
)
def test_generate_image_errors(
    live: LiveServer, form: dict, files: list | None, status: int, param: str
) -> None:
    assert post_error(f"{live.url}/generate", status, data=form, files=files) == param


def test_sdk_generate_with_images(sdk: MStarClient) -> None:
    result = sdk.generate("a kite", output_modalities=["image"], model_kwargs={"width": 256, "height": 256})
    assert isinstance(result.data["image"], bytes) and size_of(result.data["image"]) == (256, 256)
    result = sdk.generate("kites", output_modalities=["image"], model_kwargs={"n": 2})
    assert isinstance(result.data["image"], list) and len(result.data["image"]) == 2
    events = list(sdk.generate("a kite", output_modalities=["image"], stream=True))
    assert len(events) == 1 and events[0].modality == "image" and events[0].data
    assert events[0].finish_reason == "stop"


def test_a_model_that_makes_no_images_refuses_the_image_routes() -> None:
    client = TestClient(create_app(FakeBackend()))
    response = client.post("/v1/images/generations", json={"prompt": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "does not serve image_generation; it serves chat" in response.json()["error"]["message"]
    form = _generate_form("plain words")
    assert client.post("/generate", data=form).json()["text"] == "plain words"
