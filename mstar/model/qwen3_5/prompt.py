"""A Qwen3.5 multimodal prompt: placeholder tokens expanded to the media's sizes, and the
MRoPE positions of interleaved text, image and video tokens.

The chat template writes one ``<|image_pad|>`` per image and one ``<|video_pad|>`` per
video. An image's pad becomes ``t*h*w / merge**2`` pads (one per vision embedding); a
video's becomes, per temporal group of frames, ``<{seconds:.1f} seconds>`` then
``<|vision_start|>`` + its pads + ``<|vision_end|>`` (the template's own start/end pair
around the video stays).

Positions: text advances all three axes together; a frame group (an image is one) placed
at ``p`` gives its tokens ``(p, p + row, p + col)`` on the merged grid, then the text
after it resumes at ``p + max(rows, cols)``. Decode steps continue at ``position +
rope_delta`` where ``rope_delta = max position + 1 - prompt length``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar.model.qwen3_5.processor import Media


@dataclass(frozen=True)
class VisionTokens:
    image: int
    video: int
    start: int
    end: int
    merge: int


def expand_placeholders(ids: list[int], media: list[Media], tokens: VisionTokens,
                        encode: Callable[[str], list[int]]) -> list[int]:
    """``ids`` with each media placeholder replaced by its tokens (media in prompt order)."""
    pending = iter(media)
    out: list[int] = []
    for token in ids:
        if token not in (tokens.image, tokens.video):
            out.append(token)
            continue
        item = next(pending, None)
        kind = "image" if token == tokens.image else "video"
        if item is None or item.kind != kind:
            raise ValueError(f"the prompt's {kind} placeholders do not follow the request's media")
        t, h, w = item.grid
        per_group = h * w // tokens.merge**2
        if kind == "image":
            out += [tokens.image] * (t * per_group)
            continue
        for seconds in item.timestamps:
            out += encode(f"<{seconds:.1f} seconds>")
            out += [tokens.start] + [tokens.video] * per_group + [tokens.end]
    if next(pending, None) is not None:
        raise ValueError("the prompt has fewer media placeholders than the request has media")
    return out


def mrope_positions(ids: list[int], grids: list[tuple[int, int, int]], tokens: VisionTokens
                    ) -> tuple[torch.Tensor, int]:
    """``[3, len(ids)]`` int64 positions and the rope delta of an expanded prompt whose media
    have patch grids ``grids`` (prompt order; a video's frame groups follow one another)."""
    groups = iter([(1, h, w) for t, h, w in grids for _ in range(t)])
    length = len(ids)
    positions = torch.empty(3, length, dtype=torch.int64)
    media_ids = (tokens.image, tokens.video)
    i, current = 0, 0
    while i < length:
        j = i + 1
        if ids[i] in media_ids:
            while j < length and ids[j] == ids[i]:
                j += 1
            grid = next(groups, None)
            if grid is None:
                raise ValueError(f"media tokens at {i} but no media grid left")
            rows, cols = grid[1] // tokens.merge, grid[2] // tokens.merge
            if j - i != rows * cols:
                raise ValueError(f"{j - i} media tokens at {i} for a {rows}x{cols} merged grid")
            positions[0, i:j] = current
            positions[1, i:j] = current + torch.arange(rows).repeat_interleave(cols)
            positions[2, i:j] = current + torch.arange(cols).repeat(rows)
            current += max(rows, cols)
        else:
            while j < length and ids[j] not in media_ids:
                j += 1
            positions[:, i:j] = torch.arange(current, current + j - i)
            current += j - i
        i = j
    if next(groups, None) is not None:
        raise ValueError("more media grids than media token runs")
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta
