"""BAGEL's understanding side through the HTTP server on the CPU: a tiny checkpoint in the hub
snapshot's layout (``tests/support/bagel_reference.py``), dummy weights, the in-process
runtime under uvicorn in a thread, and the official ``openai`` client chatting with text and
with images (data URIs). Concurrent requests return what each returns alone (greedy); too
many images, an image over the pixel budget and a broken one each get a 400 naming the part."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from live_server import Uvicorn

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support import chat_http
from tests.support.chat_http import image, png_uri, text

MODEL = "bagel"
MAX_TOKENS = 5

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    from tests.support.bagel_reference import write_checkpoint

    checkpoint = write_checkpoint(tmp_path_factory.mktemp("bagel"))
    deployment = start(parse_config({
        "model": MODEL, "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 256,
        "max_concurrent_requests": 4, "resources": {"kv_cache": {"max_num_pages": 96, "page_size": 16}},
        # the tiny tower reads up to 8 x 8 patches of 4 pixels
        "model_kwargs": {"seed": 3, "max_images_per_request": 2, "max_image_pixels": 200 * 200,
                         "vit_resize": [32, 16], "vae_resize": [64, 32]},
    }), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)








def ask(oai: openai.OpenAI, content: list[dict] | str, **extra: object):
    return chat_http.ask(oai, MODEL, content, MAX_TOKENS, **extra)


CONTENTS = [
    [text("what is this?"), image(png_uri(1, (40, 28)))],
    [image(png_uri(2, (24, 60))), text("and"), image(png_uri(3, (32, 32)))],
    [image(png_uri(1, (40, 28)))],
    "plain text",
]


def test_text_and_image_chats(oai: openai.OpenAI) -> None:
    plain = ask(oai, [text("what is this?")])
    with_image = ask(oai, CONTENTS[0])
    for result in (plain, with_image):
        assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == MAX_TOKENS
    # "<|im_start|> what is this? <|im_end|>" and the answer's "<|im_start|>"
    assert plain.usage.prompt_tokens == len("what is this?") + 3
    # the image: 40x28 -> 48x32 (first resize) -> 32x20: 8 x 5 patches, between its two markers
    assert with_image.usage.prompt_tokens == plain.usage.prompt_tokens + 40 + 2


def test_concurrent_requests_equal_solo(oai: openai.OpenAI) -> None:
    chat_http.check_concurrent_equals_solo(oai, MODEL, CONTENTS, MAX_TOKENS, streamed=1)


@pytest.mark.parametrize(("content", "param", "rule"), [
    ([image(png_uri(4, (20, 20))), image(png_uri(5, (20, 20))), text("x"), image(png_uri(6, (20, 20)))],
     "messages[0].content[3]", "at most 2 images"),
    ([text("x"), image(png_uri(7, (300, 300)))], "messages[0].content[1]", "max_image_pixels"),
    ([text("x"), image("data:image/png;base64,iVBORw0KGgoAAAAN")], "messages[0].content[1]", "cannot decode"),
])
def test_bad_input_is_a_400_naming_the_part(oai: openai.OpenAI, content: list[dict], param: str, rule: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(oai, content)
    error = info.value.body
    assert error["param"] == param and rule in error["message"], error  # type: ignore[index]
    assert ask(oai, "still serving").usage.completion_tokens == MAX_TOKENS


def test_generate_route_takes_image_files(oai: openai.OpenAI, http) -> None:
    """``/generate`` with an uploaded image and text answers as the chat route does (image first,
    then the text); a non-image upload is a 400 naming the file's part."""
    uri = png_uri(1, (40, 28))
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        image(uri), text("what is this?")]}], max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
    options = json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0})
    png = base64.b64decode(uri.split(",", 1)[1])
    response = http.post("/generate", data={"text": "what is this?", "model_kwargs": options},
                         files=[("files", ("cat.png", png, "image/png"))])
    assert response.status_code == 200, response.text
    assert response.json()["text"] == chat
    bad = http.post("/generate", data={"text": "x", "model_kwargs": options},
                    files=[("files", ("notes.txt", b"not an image", "text/plain"))])
    assert bad.status_code == 400 and "cannot decode the image" in bad.text, bad.text


def held(http) -> tuple[float, float]:
    """The LLM's KV pages in use, and requests running or waiting (``/metrics``)."""
    text = http.get("/metrics").text
    pages = float(re.search(r'^mstar_kv_pages_used\{[^}]*node="llm"[^}]*\} (\S+)$', text, re.M).group(1))
    live = [float(m) for m in re.findall(r"^mstar_requests_(?:running|waiting) (\S+)$", text, re.M)]
    return pages, sum(live)


def test_disconnect_frees_the_pages(server: Uvicorn, oai: openai.OpenAI, http) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": CONTENTS[0]}], "max_tokens": 190,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data:"))
            assert held(http)[0] > 0
    deadline = time.monotonic() + 20
    while any(held(http)):
        assert time.monotonic() < deadline, f"still held after the client left: {held(http)}"
        time.sleep(0.05)
    assert ask(oai, CONTENTS[0]).usage.completion_tokens == MAX_TOKENS
