"""Pi0.5's front end (``Pi05.prepare_generate``): the camera batch it builds in place equals,
bit for bit, the per-image ``x / 255 * 2 - 1`` (resized with padding when not square) then
stacked, as it was built before and as lerobot writes it; the prompt ids and the seeded noise
are what the tokenizer and the generator give."""

from __future__ import annotations

import io

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
