"""Command A+'s image tiling and the image's place in the prompt, as transformers'
``Cohere2VisionImageProcessor`` and ``Cohere2VisionProcessor`` make them.

An image is resized (bicubic, antialiased, in uint8 as torchvision does it, without
needing torchvision) onto the grid of
512x512 tiles, at most ``max_tiles`` of them, whose shape needs the least upscaling (or, when
every grid must shrink the image, the least downscaling), and cut into those tiles, row by
row; a grid of more than one tile adds the whole image resized to one tile (the thumbnail).
Pixels are normalised with CLIP's mean and std. In the prompt the image is
``<BOI>`` + (256 image tokens + ``<IMG_LINE_BREAK>``) per tile + ``<EOI>``."""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TILE = 512
MAX_TILES = 12


@lru_cache(maxsize=16)
def tile_grids(max_tiles: int) -> list[tuple[int, int]]:
    """Every ``(columns, rows)`` of at most ``max_tiles`` tiles, fewest tiles first (ties in
    the order columns, then rows, ascending)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if c * r <= max_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def best_grid(height: int, width: int, tile: int = TILE, max_tiles: int = MAX_TILES) -> tuple[int, int]:
    """``(columns, rows)`` of the tiles an image of ``height x width`` is cut into. Each grid
    scales the image by the smaller of its two ratios (grid size over image size); among the
    grids that do not shrink it, the least scale wins, else the largest."""
    grids = tile_grids(max_tiles)
    scales = [min(c * tile / width, r * tile / height) for c, r in grids]
    if all(s < 1 for s in scales):
        return grids[max(range(len(grids)), key=lambda i: (scales[i], -i))]
    return grids[min(range(len(grids)), key=lambda i: (scales[i] if scales[i] >= 1 else 10e9, i))]


def _resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``image [3, H, W]`` (uint8) resized to ``height x width`` as torchvision's ``resize``
    does it (bicubic, antialiased): unchanged at its own size; on the CPU torch's uint8 kernel
    (its fixed-point sums differ from the float path by up to 8 levels); elsewhere in float32,
    clamped and rounded back to uint8."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    batch = image[None]
    if image.device.type != "cpu":
        batch = batch.float()
    out = F.interpolate(batch, size=[height, width], mode="bicubic", align_corners=False, antialias=True)[0]
    return out if out.dtype == torch.uint8 else out.clamp_(0, 255).round_().to(torch.uint8)


def tile_image(image: torch.Tensor, tile: int = TILE, max_tiles: int = MAX_TILES) -> torch.Tensor:
    """The normalised tiles ``[n, 3, tile, tile]`` (float32) of an RGB ``image [3, H, W]``
    (uint8): the grid's tiles row by row, then the thumbnail when there are several."""
    columns, rows = best_grid(image.shape[-2], image.shape[-1], tile, max_tiles)
    canvas = _resize(image, rows * tile, columns * tile)
    tiles = [canvas[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(columns)]
    if len(tiles) > 1:
        tiles.append(_resize(image, tile, tile))
    pixels = torch.stack([_resize(t, tile, tile) for t in tiles]).float()
    mean = torch.tensor(CLIP_MEAN) * 255.0
    std = torch.tensor(CLIP_STD) * 255.0
    return (pixels - mean[:, None, None]) / std[:, None, None]


def image_to_tensor(image) -> torch.Tensor:
    """A PIL image as RGB uint8 ``[3, H, W]``."""
    import numpy as np

    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def image_token_ids(num_tiles: int, tokens_per_tile: int, ids: dict[str, int]) -> list[int]:
    """The prompt ids of one image of ``num_tiles`` tiles; ``ids``: the tokenizer's ids of
    ``boi``, ``eoi``, ``image`` and ``line_break``."""
    tile = [ids["image"]] * tokens_per_tile + [ids["line_break"]]
    return [ids["boi"], *tile * num_tiles, ids["eoi"]]
