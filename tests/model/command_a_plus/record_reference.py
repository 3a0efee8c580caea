"""Record transformers' ``Cohere2VisionImageProcessor`` tiles for
``tests/model/test_command_a_plus_vision.py`` (its bit-exact check of our tiling).

The processor runs on torchvision, which has no wheel for our torch (2.13), so this script runs
once in an environment of its own and the test compares against what it wrote::

    python3 -m venv /tmp/cmdfix-ref
    /tmp/cmdfix-ref/bin/pip install torch==2.9.1 torchvision==0.24.1 transformers==5.25.0 pillow numpy
    /tmp/cmdfix-ref/bin/python tests/model/command_a_plus/record_reference.py

Writes ``tiles_reference.safetensors`` beside this file (the versions in its metadata):

* ``small.{name}.pixel_values``: the float32 tiles of each ``SMALL`` case, tiles of 32x32 (the
  processor's ``size``), whole, so a mismatch shows where it lies;
* ``full.{name}.sha256`` / ``full.{name}.tile_sums``: for each ``FULL`` case, at the released
  512x512 tiles (the processor's defaults), the SHA-256 of the float32 ``pixel_values`` bytes
  (an exact check without megabytes of fixture) and each tile's float64 sum (to locate a
  difference);
* ``{set}.{name}.num_patches``: the tile count; the grid is in the metadata.

The images are integer patterns (``make_image``), not a random generator's draws, so they are
the same in both environments whatever numpy's version."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "tiles_reference.safetensors"

# name: (width, height, max_patches); tiles of 32 (SMALL) or 512 (FULL)
SMALL = {
    "one_tile_upscaled": (21, 17, 12),  # smaller than a tile: one tile, no thumbnail
    "exact_tile": (32, 32, 12),  # resized to itself
    "landscape_odd": (97, 29, 12),  # a 4x1 grid (upscaled) + thumbnail
    "portrait_odd": (23, 101, 12),  # a 1x4 grid + thumbnail
    "many_tiles": (131, 95, 12),  # a 4x3 grid (12 tiles) + thumbnail, downscaled
    "wide_capped": (400, 41, 6),  # max 6 tiles: a 6x1 grid, downscaled
    "square_max_one": (77, 53, 1),  # max 1 tile: no grid, no thumbnail
}
FULL = {
    "small_photo": (300, 200, 12),  # one 512 tile, upscaled
    "portrait": (700, 1500, 12),
    "landscape": (2600, 500, 12),
    "odd_square": (1023, 769, 12),
}


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image of smooth gradients, stripes and a hashed texture, all integer arithmetic."""
    y, x = np.mgrid[0:height, 0:width].astype(np.int64)
    channels = []
    for c in range(3):
        gradient = (x * 255 // max(width - 1, 1) + y * 128 // max(height - 1, 1) + 60 * c) % 256
        stripes = ((x // (3 + c) + y // (5 + seed % 7)) % 2) * 40
        texture = ((x * 2654435761 + y * 40503 + (c + 1) * 97 + seed * 131) >> 7) % 64
        channels.append((gradient + stripes + texture) % 256)
    return Image.fromarray(np.stack(channels, axis=-1).astype(np.uint8), mode="RGB")


def grid(width: int, height: int, tile: int, max_patches: int) -> tuple[int, int]:
    from transformers.models.cohere2_vision.image_processing_cohere2_vision import get_optimal_tiled_canvas

    columns, rows = get_optimal_tiled_canvas((height, width), (tile, tile), 1, max_patches)
    return int(columns), int(rows)


def main() -> None:
    import PIL
    import torch
    import torchvision
    import transformers
    from safetensors.torch import save_file
    from transformers.models.cohere2_vision.image_processing_cohere2_vision import Cohere2VisionImageProcessor

    tensors: dict[str, torch.Tensor] = {}
    grids: dict[str, list[int]] = {}
    for prefix, cases, tile in (("small", SMALL, 32), ("full", FULL, 512)):
        for name, (width, height, max_patches) in cases.items():
            processor = Cohere2VisionImageProcessor(size={"height": tile, "width": tile}, max_patches=max_patches)
            out = processor(images=[make_image(width, height, seed=width)], return_tensors="pt")
            pixels = out["pixel_values"].to(torch.float32).contiguous()
            key = f"{prefix}.{name}"
            tensors[f"{key}.num_patches"] = out["num_patches"].to(torch.int64)
            grids[key] = list(grid(width, height, tile, max_patches))
            if prefix == "small":
                tensors[f"{key}.pixel_values"] = pixels
            else:
                digest = hashlib.sha256(pixels.numpy().tobytes()).digest()
                tensors[f"{key}.sha256"] = torch.tensor(list(digest), dtype=torch.uint8)
                tensors[f"{key}.tile_sums"] = pixels.double().sum(dim=(1, 2, 3))
            print(key, (width, height), "tiles", int(out["num_patches"][0]), "grid", grids[key])
    versions = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                "transformers": transformers.__version__, "pillow": PIL.__version__, "numpy": np.__version__}
    save_file(tensors, FIXTURE, metadata={"versions": json.dumps(versions), "grids": json.dumps(grids)})
    print("wrote", FIXTURE, FIXTURE.stat().st_size, "bytes", versions)


if __name__ == "__main__":
    main()
