"""Pi0.5's front end (``Pi05.prepare_generate``): the camera batch it builds in place equals,
bit for bit, the per-image ``x / 255 * 2 - 1`` (resized with padding when not square) then
stacked, as it was built before and as lerobot writes it; the prompt ids and the seeded noise
are what the tokenizer and the generator give."""

from __future__ import annotations

import io
import json
import os
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.model.pi05.model import Pi05, prompt_text, resize_with_pad
from tests.support.pi05 import write_checkpoint

STATE = [0.2, -1.0, 3.0, 0.5]


def png(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def reference_pixels(data: bytes, size: int) -> torch.Tensor:
    """One camera as the front end built it per image before (and lerobot does)."""
    rgb = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
    return resize_with_pad(rgb.permute(2, 0, 1).float() / 255.0, size) * 2.0 - 1.0


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Pi05:
    root = tmp_path_factory.mktemp("pi05-front")
    write_checkpoint(root)
    spec = Pi05(parse_config({"model": "pi05", "model_path": str(root), "load_format": "dummy"}))
    spec.load_frontend()
    return spec


@pytest.mark.parametrize("cameras", [
    [(16, 16, "RGB")],  # the tower's square: no resize
    [(16, 16, "RGB"), (24, 10, "RGB")],  # a wide image: resized and padded
    [(9, 20, "L"), (16, 16, "RGBA")],  # a tall grey image; an opaque RGBA one
], ids=["square", "square+wide", "tall-grey+rgba"])
def test_prepared_inputs_equal_per_image_reference(spec: Pi05, cameras: list[tuple[int, int, str]]) -> None:
    files = [png(w, h, seed, mode) for seed, (w, h, mode) in enumerate(cameras)]
    size = spec.model_config.vision.image_size
    request = spec.prepare_generate(GenerateSpec("front", "pick_up the cube\n", [(f"c{i}.png", f) for i, f in
                                                                              enumerate(files)], ["action"],
                                                 {"state": STATE, "seed": 7}))
    pixels = request.inputs["pixels"]
    assert pixels.dtype == torch.float32 and pixels.shape == (len(files), 3, size, size)
    assert torch.equal(pixels, torch.stack([reference_pixels(f, size) for f in files]))
    state = spec.embodiment("").state.normalize(torch.tensor(STATE))
    want_ids = spec.tokenizer(prompt_text("pick_up the cube\n", state)).input_ids
    assert request.inputs["prompt_ids"].tolist() == want_ids
    config = spec.model_config
    noise = torch.randn(config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(7))
    assert torch.equal(request.inputs["actions"], noise)


def test_a_bad_camera_is_named(spec: Pi05) -> None:
    with pytest.raises(RequestError) as err:
        spec.prepare_generate(GenerateSpec("bad", "go", [("a.png", png(16, 16, 0)), ("b.png", b"not a png")],
                                           ["action"], {"state": STATE}))
    assert err.value.field == "files.1"


def _threads_after(work) -> int:
    """How many threads this process has at the end of ``work`` run in a new thread."""
    seen = []

    def run() -> None:
        work()
        seen.append(len(os.listdir("/proc/self/task")))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_the_front_end_starts_no_intra_op_threads(tmp_path) -> None:
    """A server prepares concurrent requests in threads, and a torch op big enough to run in
    parallel starts a team of intra-op threads for each thread that calls it: sixteen requests
    on a 16-core host spent 2.2 ms a division of one 224x224 camera (2026-12-07). Cameras at
    the tower's size are decoded and scaled in numpy; this holds the front end to that."""
    write_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "image_resolution": [224, 224]}))
    spec = Pi05(parse_config({"model": "pi05", "model_path": str(tmp_path), "load_format": "dummy"}))
    spec.load_frontend()
    cameras = [(f"c{i}.png", png(224, 224, i)) for i in range(len(spec.model_config.cameras))]
    request = GenerateSpec("front", "go", cameras, ["action"], {"state": STATE, "seed": 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        _threads_after(lambda: spec.prepare_generate(request))  # first use: the tokenizer's own pool
        alone = _threads_after(lambda: None)
        assert _threads_after(lambda: torch.ones(3, 224, 224).div_(255.0)) > alone  # a team is seen here
        assert _threads_after(lambda: spec.prepare_generate(request)) == alone
    finally:
        torch.set_num_threads(threads)
