"""How audio, images and videos enter the thinker's token sequence.

A clip is a run ``<|audio_start|> <|audio_pad|> x n <|audio_end|>`` in the prompt, ``n`` the
encoder's token count for it (``audio.audio_token_count``); an image is a run
``<|vision_start|> <|image_pad|> x n <|vision_end|>``, ``n = t * h * w / merge**2`` of its
patch grid, and a video the same with ``<|video_pad|>`` (all its temporal groups in one run).
A video heard with its soundtrack (``use_audio_in_video``) holds ``<|audio_start|>``, its
video and audio pads interleaved by time (``interleave_audio``) and ``<|audio_end|>`` inside
its vision run. The thinker's embeddings of the pad tokens are replaced, in order, by the
encoders' output rows; image and video rows also bring their deepstack features
(``Deepstack``; ``splice_vision`` takes both kinds, encoded together in prompt order).

Positions (the reference's ``get_rope_index``, ``media_positions``): text and audio tokens
advance all three MRoPE axes together; an image whose first pad token would sit at ``p``
gives its tokens ``(p, p + row, p + col)`` on the merged grid, a video's temporal group ``k``
adds ``k * seconds_per_grid * position_id_per_seconds`` on the first axis, and the token after
a run resumes one past its largest position. ``image_positions`` (images only) is Qwen3.5's
rule, ``mstar.model.qwen3_5.prompt.mrope_positions``. Without images or videos every axis is
``0 .. L-1`` and an audio+text prompt runs on the paged metadata's 1-D positions. Later steps
of a request run at ``position + rope_delta`` on all three axes (``shifted_positions``).
"""

from __future__ import annotations

import torch

from mstar.model.qwen3_5.prompt import VisionTokens, mrope_positions
from mstar.model.qwen3_omni.modeling import Deepstack
from mstar.model.qwen3_omni.vision import Qwen3OmniVisionConfig, VisionFeatures


def audio_run(num_tokens: int, start_id: int, pad_id: int, end_id: int) -> list[int]:
    """The prompt token ids standing for one clip of ``num_tokens`` encoder tokens."""
    return [start_id, *([pad_id] * num_tokens), end_id]


def image_run(grid: tuple[int, int, int], config: Qwen3OmniVisionConfig, *, video: bool = False) -> list[int]:
    """The prompt token ids standing for one image (or ``video``) of patch grid ``(t, h, w)``."""
    t, h, w = grid
    count = t * h * w // config.spatial_merge_size**2
    pad = config.video_token_id if video else config.image_token_id
    return [config.vision_start_token_id, *([pad] * count), config.vision_end_token_id]


def interleave_audio(grid: tuple[int, int, int], seconds_per_grid: float, audio_tokens: int,
                     config: Qwen3OmniVisionConfig, audio_id: int) -> list[int]:
    """The pads of a video with its soundtrack (``use_audio_in_video``), in time order: temporal
    group ``k`` (its ``h * w / merge**2`` video pads) sits at ``k * seconds_per_grid *
    position_id_per_seconds``, audio token ``a`` at ``a``; a group goes before an audio token
    at the same time (the processor's rule). The prompt holds them between ``<|vision_start|><|audio_start|>`` and
    ``<|audio_end|><|vision_end|>``."""
    t, h, w = grid
    per_group = h * w // config.spatial_merge_size**2
    times = (torch.arange(t) * torch.tensor(float(seconds_per_grid)) * config.position_id_per_seconds).tolist()
    out: list[int] = []
    audio = 0
    for time in times:
        while audio < audio_tokens and audio < time:
            out.append(audio_id)
            audio += 1
        out += [config.video_token_id] * per_group
    return out + [audio_id] * (audio_tokens - audio)


def splice_features(embeds: torch.Tensor, input_ids: torch.Tensor, pad_id: int,
                    features: list[torch.Tensor], kind: str = "audio") -> torch.Tensor:
    """``embeds [T, hidden]`` with the rows of the ``pad_id`` tokens of ``input_ids [T]``
    replaced by ``features`` (concatenated in order); their counts must match."""
    rows = torch.cat(features) if features else embeds.new_zeros(0, embeds.shape[1])
    mask = input_ids == pad_id
    if int(mask.sum()) != rows.shape[0]:
        raise ValueError(f"{int(mask.sum())} {kind} placeholder tokens for {rows.shape[0]} {kind} feature rows")
    out = embeds.clone()
    out[mask] = rows.to(embeds.dtype)
    return out


def splice_images(embeds: torch.Tensor, input_ids: torch.Tensor, pad_id: int,
                  images: VisionFeatures) -> tuple[torch.Tensor, Deepstack]:
    """The image pad tokens' embeddings replaced by the encoder's rows, and the deepstack
    features of those tokens for the decoder's first layers."""
    out = splice_features(embeds, input_ids, pad_id, [images.embeds], kind="image")
    return out, Deepstack(input_ids == pad_id, list(images.deepstack))


def splice_vision(embeds: torch.Tensor, input_ids: torch.Tensor, config: Qwen3OmniVisionConfig,
                  features: VisionFeatures) -> tuple[torch.Tensor, Deepstack]:
    """The image and video pad tokens' embeddings replaced by the encoder's rows (its images
    and videos encoded in prompt order, so its rows follow the pads), and their deepstack
    features. The reference scatters images and videos apart and joins their deepstack rows
    in sequence order; encoding them together in prompt order gives the same rows."""
    rows = (input_ids == config.image_token_id) | (input_ids == config.video_token_id)
    if int(rows.sum()) != features.embeds.shape[0]:
        raise ValueError(f"{int(rows.sum())} image and video placeholder tokens for {features.embeds.shape[0]} "
                         "vision feature rows")
    out = embeds.clone()
    out[rows] = features.embeds.to(embeds.dtype)
    return out, Deepstack(rows, list(features.deepstack))


def image_positions(ids: list[int], grids: list[tuple[int, int, int]], config: Qwen3OmniVisionConfig
                    ) -> tuple[torch.Tensor, int]:
    """``[3, len(ids)]`` int64 MRoPE positions of a prompt of text, audio and image runs
    (``grids``: the images' patch grids in prompt order) and its rope delta (the later steps'
    shift: ``max position + 1 - len(ids)``)."""
    if config.video_token_id in ids:
        raise ValueError("a prompt with video runs takes media_positions (it needs the videos' seconds per grid)")
    if any(t != 1 for t, _, _ in grids):
        raise ValueError(f"image grids {grids} must have t = 1 (a video's frames take other positions)")
    tokens = VisionTokens(image=config.image_token_id, video=config.video_token_id,
                          start=config.vision_start_token_id, end=config.vision_end_token_id,
                          merge=config.spatial_merge_size)
    return mrope_positions(ids, grids, tokens)


def media_positions(ids: list[int], grids: list[tuple[int, int, int]], seconds_per_grid: list[float],
                    config: Qwen3OmniVisionConfig, *, audio_token: int | None = None
                    ) -> tuple[torch.Tensor, int | float]:
    """``[3, len(ids)]`` MRoPE positions of a prompt of text, audio, image and video runs, and
    its rope delta. ``grids``: the images' and videos' patch grids in prompt order;
    ``seconds_per_grid``: each video's seconds per temporal group, in order.

    A video run placed at ``p`` gives the token of temporal group ``k``, merged row ``r`` and
    column ``c`` the positions ``(p + k * seconds_per_grid * position_id_per_seconds, p + r,
    p + c)``; the token after a run sits one past the run's largest position. The maths is
    float32, as the reference's; the positions come back int64 when they are all whole
    numbers (always, unless a video's step is fractional), float32 otherwise.

    With ``audio_token``, a video run may hold its soundtrack's ``audio_token`` pads
    interleaved by time (``interleave_audio``): the audio pads take ``p, p + 1, ...`` on all
    three axes and the video pads their places above, both from the same ``p``; the token after
    the run sits one past the largest position of the run's trailing tokens of one kind (the
    reference's rule: its last piece, not the whole run)."""
    image, video = config.image_token_id, config.video_token_id
    merge = config.spatial_merge_size
    pending, seconds = iter(grids), iter(seconds_per_grid)
    pieces: list[torch.Tensor] = []
    start = torch.tensor(0.0)
    i, length = 0, len(ids)
    while i < length:
        j = i + 1
        if ids[i] in (image, video):
            kinds = (ids[i], audio_token) if ids[i] == video and audio_token is not None else (ids[i],)
            while j < length and ids[j] in kinds:
                j += 1
            grid = next(pending, None)
            if grid is None:
                raise ValueError(f"vision tokens at {i} but no grid left")
            t, rows, cols = grid[0], grid[1] // merge, grid[2] // merge
            run = torch.tensor(ids[i:j])
            pads = run == ids[i]
            if int(pads.sum()) != t * rows * cols:
                raise ValueError(f"{int(pads.sum())} vision tokens at {i} for a {t}x{rows}x{cols} merged grid")
            if ids[i] == image:
                step = torch.arange(t) * config.position_id_per_seconds
            else:
                spg = next(seconds, None)
                if spg is None:
                    raise ValueError(f"video tokens at {i} but no seconds per grid left")
                step = torch.arange(t) * torch.tensor(float(spg)) * config.position_id_per_seconds
            block = torch.stack([step.float().repeat_interleave(rows * cols),
                                 torch.arange(rows).repeat_interleave(cols).repeat(t).float(),
                                 torch.arange(cols).repeat(rows * t).float()])
            last = block + start
            if not bool(pads.all()):  # a video with its soundtrack between its groups
                placed = torch.empty(3, j - i)
                placed[:, pads] = block
                placed[:, ~pads] = torch.arange(int((~pads).sum())).float()[None].expand(3, -1)
                last = placed + start
                pieces.append(last)
                other = (run != run[-1]).nonzero()
                last = last[:, int(other.max()) + 1:]  # the trailing tokens of one kind
            else:
                pieces.append(last)
        else:
            while j < length and ids[j] not in (image, video):
                j += 1
            last = torch.arange(j - i)[None].expand(3, -1) + start
            pieces.append(last)
        start = last.max() + 1
        i = j
    if next(pending, None) is not None or next(seconds, None) is not None:
        raise ValueError("more grids (or video seconds) than vision token runs")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0)
    delta = float(positions.max()) + 1 - length if length else 0.0
    if torch.equal(positions, positions.round()):
        return positions.long(), int(delta)
    return positions, delta


def shifted_positions(positions: torch.Tensor, rope_delta: int) -> torch.Tensor:
    """``[3, T]`` MRoPE positions of a request's later tokens from their 1-D sequence positions."""
    return (positions + rope_delta)[None].expand(3, -1)
