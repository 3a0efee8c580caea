"""A Qwen3-Omni chat request's prompt: its media taken out of the messages and processed, the
chat template's one placeholder per clip or image expanded to the encoder's token count, and
the thinker's media inputs.

Content parts are ``{"type": "text", "text"}``, ``{"type": "audio", "data": bytes}`` (the
uploaded file: WAV, FLAC, OGG or MP3, decoded here to 16 kHz mono, capped at
``max_audio_seconds``) and ``{"type": "image", "data": bytes}``. The template sees them as
``{"type": "audio" | "image" | "video"}`` and writes ``<|audio_start|><|audio_pad|><|audio_end|>``
/ ``<|vision_start|><|image_pad|><|vision_end|>`` / ``<|vision_start|><|video_pad|><|vision_end|>``
where each stands. ``{"type": "video", "data": bytes}`` is a video file (``video.read_video``:
sampled, capped at ``max_video_pixels``); with ``"use_audio_in_video": true`` its soundtrack
is heard too, its audio tokens interleaved with the frame groups by time
(``inputs.interleave_audio``) between ``<|audio_start|>`` and ``<|audio_end|>`` inside the
vision run. A part the rules refuse raises ``RequestError`` naming ``messages[i].content[j]``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
from typing import Any

import torch

from mstar.contract import RequestError
from mstar.model.chat import split_content
from mstar.model.qwen3_5.processor import ImageProcessing, Media, MediaError, VideoProcessing, process_image
from mstar.model.qwen3_omni.audio import Qwen3OmniAudioConfig, audio_token_count, mel_features
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.inputs import interleave_audio, media_positions
from mstar.model.qwen3_omni.knobs import Qwen3OmniKnobs
from mstar.model.qwen3_omni.speech import ChatTokens
from mstar.model.qwen3_omni.video import VideoClip, read_soundtrack, read_video, video_settings
from mstar.model.qwen3_omni.vision import Qwen3OmniVisionConfig

AUDIO_RATE = 16000


def chat_tokens(d: dict[str, Any]) -> ChatTokens:
    """The chat and media ids of a whole Omni ``config.json`` dict."""
    tokens = ChatTokens.from_hf_dict(d)
    return replace(tokens, im_end=d["im_end_token_id"]) if d.get("im_end_token_id") is not None else tokens


def accept_hidden_layer(d: dict[str, Any]) -> int:
    from mstar.model.qwen3_omni.talker import Qwen3OmniTalkerConfig

    return Qwen3OmniTalkerConfig.from_hf_dict(d).accept_hidden_layer


@dataclass
class Clip:
    mel: torch.Tensor  # [num_mel_bins, frames]
    tokens: int


@dataclass
class PromptBuilder:
    tokens: ChatTokens
    audio: Qwen3OmniAudioConfig
    vision: Qwen3OmniVisionConfig
    images: ImageProcessing
    videos: VideoProcessing
    knobs: Qwen3OmniKnobs
    speakers: dict[str, int]
    eos: int | list[int] | None
    audio_bounds: tuple[int, int] | None = None  # <|audio_start|>, <|audio_end|>: for use_audio_in_video

    @classmethod
    def from_checkpoint(cls, ckpt, tokenizer, knobs: Qwen3OmniKnobs) -> PromptBuilder:
        from mstar.model.qwen3_omni.talker import Qwen3OmniTalkerConfig

        d = ckpt.hf_config()
        tokens = chat_tokens(d)
        named = {key: tokenizer.convert_tokens_to_ids(name) for key, name in
                 (("im_end", "<|im_end|>"), ("vision_end", "<|vision_end|>"), ("audio_start", "<|audio_start|>"),
                  ("audio_end", "<|audio_end|>"))}
        if d.get("im_end_token_id") is None and isinstance(named["im_end"], int):
            tokens = replace(tokens, im_end=named["im_end"])
        vision = Qwen3OmniVisionConfig.from_hf_dict(d)
        if isinstance(named["vision_end"], int) and named["vision_end"] != tokenizer.unk_token_id:
            vision = replace(vision, vision_end_token_id=named["vision_end"])
        v = vision
        file = ckpt.path / "preprocessor_config.json"
        processor = json.loads(file.read_text()) if file.is_file() else {}
        images = ImageProcessing.from_hf_dict({"patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
                                               "merge_size": v.spatial_merge_size} | processor)
        file = ckpt.path / "video_preprocessor_config.json"  # else the image one, as transformers falls back
        videos = video_settings(
            json.loads(file.read_text()) if file.is_file() else processor, patch_size=v.patch_size,
            temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size, fps=knobs.video_fps,
            max_frames=knobs.max_video_frames)
        talker = Qwen3OmniTalkerConfig.from_hf_dict(d)
        bounds = (named["audio_start"], named["audio_end"])
        known = all(isinstance(b, int) and b != tokenizer.unk_token_id for b in bounds)
        return cls(tokens, Qwen3OmniAudioConfig.from_hf_dict(d), vision, images, videos, knobs,
                   dict(talker.speaker_id), Qwen3OmniTextConfig.from_hf_dict(d).eos_token_id,
                   bounds if known else None)

    # ------------------------------------------------------------------ media out of the messages
    def split(self, messages: list[dict]) -> tuple[list[dict], list[Clip | Media | VideoClip]]:
        """The messages as the chat template takes them, and their clips, images and videos in order."""
        media: list[Clip | Media | VideoClip] = []

        def take(kind: str, part: dict, where: str) -> None:
            if len(media) >= self.knobs.max_media_per_request:
                raise RequestError(where, f"at most {self.knobs.max_media_per_request} audio clips, images and "
                                          "videos per request")
            data = part.get("data")
            if kind == "video":
                media.append(self._video(data, where, bool(part.get("use_audio_in_video"))))
            else:
                media.append(self._clip(data, where) if kind == "audio" else self._image(data, where))

        return split_content(messages, ("audio", "image", "video"), take), media

    def _clip(self, data: Any, where: str) -> Clip:
        from mstar.audio import AudioError, decode_audio

        if not isinstance(data, (bytes, bytearray)):
            raise RequestError(where, "an audio part needs data: the audio file's bytes")
        try:
            decoded = decode_audio(bytes(data), max_bytes=self.knobs.max_upload_bytes,
                                   max_seconds=self.knobs.max_audio_seconds, target_rate=AUDIO_RATE)
        except AudioError as err:
            raise RequestError(where, err.message, err.status) from None
        return self._mel(decoded.samples, where)

    def _mel(self, samples, where: str) -> Clip:
        wave = torch.from_numpy(samples.copy())
        mel = mel_features(wave, self.audio.num_mel_bins)
        if mel.shape[1] == 0:
            raise RequestError(where, "the audio is shorter than one 10 ms frame")
        return Clip(mel, audio_token_count(mel.shape[1], self.audio.n_window))

    def _image(self, data: Any, where: str) -> Media:
        from PIL import Image

        if not isinstance(data, (bytes, bytearray)):
            raise RequestError(where, "an image part needs data: the image's bytes")
        try:
            image = Image.open(io.BytesIO(bytes(data)))
            width, height = image.size
            if width * height > self.knobs.max_image_pixels:
                raise MediaError(f"image of {width}x{height} = {width * height} pixels exceeds max_image_pixels "
                                 f"({self.knobs.max_image_pixels})")
            image.load()
            return process_image(image, self.images)
        except MediaError as err:
            raise RequestError(where, str(err)) from None
        except Exception as err:
            raise RequestError(where, f"cannot decode the image: {err}") from None

    def _video(self, data: Any, where: str, with_audio: bool) -> VideoClip:
        if not isinstance(data, (bytes, bytearray)):
            raise RequestError(where, "a video part needs data: the video file's bytes")
        if len(data) > self.knobs.max_upload_bytes:
            raise RequestError(where, f"video of {len(data)} bytes exceeds max_upload_bytes "
                                      f"({self.knobs.max_upload_bytes})")
        if with_audio and self.audio_bounds is None:
            raise RequestError(where, "use_audio_in_video needs <|audio_start|> and <|audio_end|> in the tokenizer")
        try:
            clip = read_video(bytes(data), self.videos, self.knobs.max_video_pixels)
            if with_audio:
                clip.audio = self._mel(read_soundtrack(bytes(data), AUDIO_RATE, self.knobs.max_audio_seconds), where)
            return clip
        except MediaError as err:
            raise RequestError(where, str(err)) from None
        except ModuleNotFoundError as err:  # PyAV is an optional dependency
            raise RequestError(where, f"video input is not available on this server: {err}") from None

    # ---------------------------------------------------------------- the prompt's media runs
    def expand(self, ids: list[int], media: list[Clip | Media | VideoClip]
               ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The template's ids with each media placeholder repeated to its token count, and the
        thinker's media inputs (``MEDIA_INPUTS``: the images' and videos' patches and grids in
        prompt order, and the prompt's 3-axis positions when it has either)."""
        audio, image, video = self.tokens.audio, self.vision.image_token_id, self.vision.video_token_id
        kinds = {audio: [m for m in media if isinstance(m, Clip)],
                 image: [m for m in media if isinstance(m, Media)],
                 video: [m for m in media if isinstance(m, VideoClip)]}
        counts = {token: sum(1 for t in ids if t == token) for token in kinds}
        if any(counts[token] != len(items) for token, items in kinds.items()):
            raise RequestError("messages", f"the prompt has {counts[audio]} audio, {counts[image]} image and "
                                           f"{counts[video]} video placeholders for {len(kinds[audio])} clips, "
                                           f"{len(kinds[image])} images and {len(kinds[video])} videos "
                                           "(text may not contain them)")
        merge = self.vision.spatial_merge_size ** 2
        queues = {token: iter(items) for token, items in kinds.items()}
        out: list[int] = []
        seen: list[Media] = []  # images and videos in prompt order
        heard: list[Clip] = []  # audio clips (a video's soundtrack included) in prompt order
        seconds: list[float] = []
        for token in ids:
            if token not in queues:
                out.append(token)
                continue
            item = next(queues[token])
            if isinstance(item, Clip):
                out += [token] * item.tokens
                heard.append(item)
                continue
            if isinstance(item, VideoClip):
                seconds.append(item.seconds_per_grid)
                if item.audio is not None:
                    start, end = self.audio_bounds
                    out += [start, *interleave_audio(item.media.grid, item.seconds_per_grid, item.audio.tokens,
                                                     self.vision, audio), end]
                    heard.append(item.audio)
                    seen.append(item.media)
                    continue
                item = item.media
            t, h, w = item.grid
            out += [token] * (t * h * w // merge)
            seen.append(item)
        inputs = self.no_media()
        if heard:
            inputs["audio_mels"] = torch.cat([c.mel for c in heard], dim=1)
            inputs["audio_frames"] = torch.tensor([c.mel.shape[1] for c in heard], dtype=torch.int64)
        if seen:
            inputs["pixel_values"] = torch.cat([m.patches for m in seen])
            inputs["grid_thw"] = torch.tensor([m.grid for m in seen], dtype=torch.int64)
            inputs["positions"], _ = media_positions(out, [m.grid for m in seen], seconds, self.vision,
                                                     audio_token=audio)
        return out, inputs

    def no_media(self) -> dict[str, torch.Tensor]:
        """Empty media inputs (every walk takes them)."""
        v = self.vision
        patch = 3 * v.temporal_patch_size * v.patch_size ** 2
        return {"audio_mels": torch.zeros(self.audio.num_mel_bins, 0),
                "audio_frames": torch.zeros(0, dtype=torch.int64),
                "pixel_values": torch.zeros(0, patch), "grid_thw": torch.zeros(0, 3, dtype=torch.int64),
                "positions": torch.zeros(3, 0, dtype=torch.int64)}
