"""The Cosmos3-Edge reasoner's chat frontend: a chat's image and video parts become the
reasoner's prompt ids, patches and rotary positions (``mstar.model.cosmos3.reasoner``).

The chat is rendered with the text tokenizer's chat template, each media part standing as a
private marker in its message's text; the rendered prompt is tokenized piece by piece between
the markers and each marker replaced by its media block: an image is ``<|vision_start|>``, one
image token per merged 2 x 2 patch group, ``<|vision_end|>``; a video is, per sampled frame,
the text ``<T.T seconds>`` then the same block with video tokens (the reference processor's
layout). Frames are sampled as the reference's video processor samples them
(``reasoner_video_fps`` a second, 2 by default, at least 4 and at most ``reasoner_max_frames``,
evenly spread) and resized together (``video_patches``).

Limits (each a 400 naming the part): ``reasoner_max_images`` images and
``reasoner_max_videos`` videos per chat, images and frames within
``reasoner_max_image_pixels`` before resizing, a part that does not decode.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch

from mstar.contract import ChatSpec, RequestError
from mstar.graph import Emit, Loop, Node, Sequential, Step, Walk
from mstar.model.chat import ChatLLM, split_content
from mstar.model.cosmos3.reasoner import ReasonerConfig, image_patches, rope_positions, sample_frames, video_patches
from mstar.model.decoding import checked_sampling
from mstar.model.spec import WalkRequest

MARK = "\ue000"  # a private-use character: where a media part sits in the rendered prompt


@dataclass
class ChatMedia:
    """A chat's prompt: ``ids``, and for media its ``pixel_values``, ``grid_thw`` and
    ``rope_positions`` (None when text only)."""

    ids: list[int]
    pixel_values: torch.Tensor | None = None
    grid_thw: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None
    grids: list[tuple[int, int, int]] = field(default_factory=list)


def _image(data, where: str, max_area: int):
    from PIL import Image

    if not isinstance(data, (bytes, bytearray)):
        raise RequestError(where, "an image part needs its bytes")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as err:
        raise RequestError(where, f"cannot decode the image: {err}") from None
    if image.width * image.height > max_area:
        raise RequestError(where, f"image of {image.width}x{image.height} exceeds reasoner_max_image_pixels "
                                  f"({max_area})")
    return image


def _frames(data, where: str, fps: float, max_frames: int, max_area: int):
    """The sampled frames ``uint8 [T, H, W, 3]`` and their times in seconds."""
    from mstar.media.video import decode_mp4

    if not isinstance(data, (bytes, bytearray)):
        raise RequestError(where, "a video part needs its bytes")
    try:
        frames, rate = decode_mp4(bytes(data))
    except Exception as err:
        raise RequestError(where, f"cannot decode the video: {err}") from None
    if len(frames) == 0:
        raise RequestError(where, "the video has no frames")
    if frames.shape[1] * frames.shape[2] > max_area:
        raise RequestError(where, f"video of {frames.shape[2]}x{frames.shape[1]} exceeds reasoner_max_image_pixels "
                                  f"({max_area})")
    rate = rate or 24.0
    indices = sample_frames(len(frames), rate, fps, max_frames=max_frames)
    return frames[indices], [i / rate for i in indices]


def chat_prompt(messages: list[dict], tokenizer, config: ReasonerConfig, *, max_images: int, max_videos: int,
                max_area: int, video_fps: float, max_frames: int, enable_thinking: bool | None) -> ChatMedia:
    """The reasoner's prompt for ``messages`` (parts as ``ChatSpec`` carries them)."""
    media: list[tuple[str, object, str]] = []
    counts = {"image": 0, "video": 0}
    limits = {"image": max_images, "video": max_videos}

    def take(kind: str, part: dict, where: str) -> None:
        counts[kind] += 1
        if counts[kind] > limits[kind]:
            raise RequestError(where, f"at most {limits[kind]} {kind}s per chat")
        media.append((kind, part.get("data"), where))

    split = split_content(messages, ("image", "video"), take)
    rendered = []
    for message in split:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part["text"] if part["type"] == "text" else MARK for part in content)
        rendered.append({**message, "content": content})
    template = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **template)
    except Exception as err:
        raise RequestError("messages", f"cannot apply the chat template: {err}") from None
    pieces = text.split(MARK)
    if len(pieces) != len(media) + 1:
        raise RequestError("messages", "a message's text holds the reserved character U+E000")
    reserved = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                config.vision_end_token_id}

    def encode(piece: str) -> list[int]:
        out = tokenizer.encode(piece, add_special_tokens=False)
        if reserved.intersection(out):
            raise RequestError("messages", "the text holds an image or video placeholder token")
        return out

    ids: list[int] = encode(pieces[0])
    patches, grids = [], []
    merge = config.spatial_merge_size
    for (kind, data, where), piece in zip(media, pieces[1:]):
        if kind == "image":
            p, grid = image_patches(_image(data, where, max_area), config)
            patches.append(p)
            grids.append(grid)
            ids += [config.vision_start_token_id, *[config.image_token_id] * (grid[1] * grid[2] // merge ** 2),
                    config.vision_end_token_id]
        else:
            frames, times = _frames(data, where, video_fps, max_frames, max_area)
            p, grid = video_patches(frames, config)
            patches.append(p)
            grids.append(grid)
            for seconds in times:
                ids += encode(f"<{seconds:.1f} seconds>")
                ids += [config.vision_start_token_id, *[config.video_token_id] * (grid[1] * grid[2] // merge ** 2),
                        config.vision_end_token_id]
        ids += encode(piece)
    if not media:
        return ChatMedia(ids)
    positions = rope_positions(torch.tensor(ids), grids, (config.image_token_id, config.video_token_id), merge)
    return ChatMedia(ids, torch.cat(patches), torch.tensor(grids, dtype=torch.int64), positions, grids)


class ReasonerChat(ChatLLM):
    """The chat side of ``cosmos3_edge``: walks ``chat`` (text) and ``chat_vision`` (the
    ``vision`` node first) over the ``llm`` node (the reasoner on the autoregressive engine).
    The model class sets ``tokenizer``, ``stop_token_ids`` and ``reasoner_config`` (None: the
    checkpoint has no ``reasoner/`` folder, and chats are refused naming the model)."""

    kv_upfront = True  # never preempted: a media token's K/V are not recomputed from its id
    reasoner_config: ReasonerConfig | None = None

    def chat_graph(self) -> tuple[list[Node], list[Walk]]:
        vision = Node("vision", "stateless", inputs=("pixel_values", "grid_thw"), outputs=("vision_embeds",))
        llm = Node("llm", "autoregressive", inputs=("prompt_ids", "vision_embeds", "rope_positions", "token"),
                   outputs=("token",), ops=("prefill", "decode"), flags=("stop",))

        def decode_loop() -> Loop:
            decode = Step("llm", "decode", reads="token", writes="token", emit=Emit("token", "text"))
            return Loop(decode, until="stop", max_iters="max_decode_steps")

        chat = Walk("chat", Sequential(
            Step("llm", "prefill", reads="prompt_ids", writes="token", emit=Emit("token", "text")),
            decode_loop()), inputs="prompt_ids")
        chat_vision = Walk("chat_vision", Sequential(
            Step("vision", reads=("pixel_values", "grid_thw"), writes="vision_embeds"),
            Step("llm", "prefill", reads=("prompt_ids", "vision_embeds", "rope_positions"), writes="token",
                 emit=Emit("token", "text")),
            decode_loop()), inputs=("prompt_ids", "pixel_values", "grid_thw", "rope_positions"))
        return [vision, llm], [chat, chat_vision]

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        if self.reasoner_config is None:
            raise RequestError("model", f"model {self.key!r}: this checkpoint has no reasoner/ folder", 400)
        checked_sampling(spec.sampling)
        k = self.knobs
        prompt = chat_prompt(spec.messages, self.tokenizer, self.reasoner_config, max_images=k.reasoner_max_images,
                             max_videos=k.reasoner_max_videos, max_area=k.reasoner_max_image_pixels,
                             video_fps=k.reasoner_video_fps, max_frames=k.reasoner_max_frames,
                             enable_thinking=spec.enable_thinking)
        request = self.text_request(prompt.ids, spec.max_tokens, spec.sampling, spec.ignore_eos)
        if prompt.pixel_values is not None:
            request.walk = "chat_vision"
            request.inputs.update(pixel_values=prompt.pixel_values, grid_thw=prompt.grid_thw,
                                  rope_positions=prompt.rope_positions)
        return request
