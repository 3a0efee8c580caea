"""A Qwen3-Omni chat request's prompt: its media taken out of the messages and processed, the
chat template's one placeholder per clip or image expanded to the encoder's token count, and
the thinker's media inputs.

Content parts are ``{"type": "text", "text"}``, ``{"type": "audio", "data": bytes}`` (the
uploaded file: WAV, FLAC, OGG or MP3, decoded here to 16 kHz mono, capped at
``max_audio_seconds``) and ``{"type": "image", "data": bytes}``. The template sees them as
``{"type": "audio" | "image"}`` and writes ``<|audio_start|><|audio_pad|><|audio_end|>`` /
``<|vision_start|><|image_pad|><|vision_end|>`` where each stands. Video is refused. A part
the rules refuse raises ``RequestError`` naming ``messages[i].content[j]``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
from typing import Any

import torch

from mstar.contract import RequestError
from mstar.model.chat import split_content
from mstar.model.qwen3_5.processor import ImageProcessing, Media, MediaError, process_image
from mstar.model.qwen3_omni.audio import Qwen3OmniAudioConfig, audio_token_count, mel_features
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.inputs import image_positions
from mstar.model.qwen3_omni.knobs import Qwen3OmniKnobs
from mstar.model.qwen3_omni.speech import ChatTokens
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
    knobs: Qwen3OmniKnobs
    speakers: dict[str, int]
    eos: int | list[int] | None

    @classmethod
    def from_checkpoint(cls, ckpt, tokenizer, knobs: Qwen3OmniKnobs) -> PromptBuilder:
        from mstar.model.qwen3_omni.talker import Qwen3OmniTalkerConfig

        d = ckpt.hf_config()
        tokens = chat_tokens(d)
        named = {key: tokenizer.convert_tokens_to_ids(name) for key, name in
                 (("im_end", "<|im_end|>"), ("vision_end", "<|vision_end|>"))}
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
        talker = Qwen3OmniTalkerConfig.from_hf_dict(d)
        return cls(tokens, Qwen3OmniAudioConfig.from_hf_dict(d), vision, images, knobs, dict(talker.speaker_id),
                   Qwen3OmniTextConfig.from_hf_dict(d).eos_token_id)

    # ------------------------------------------------------------------ media out of the messages
    def split(self, messages: list[dict]) -> tuple[list[dict], list[Clip | Media]]:
        """The messages as the chat template takes them, and their clips and images in order."""
        media: list[Clip | Media] = []

        def take(kind: str, part: dict, where: str) -> None:
            if kind == "video":
                raise RequestError(where, "video input is not supported by qwen3_omni yet; send audio or images")
            if len(media) >= self.knobs.max_media_per_request:
                raise RequestError(where, f"at most {self.knobs.max_media_per_request} audio clips and images "
                                          "per request")
            data = part.get("data")
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
        wave = torch.from_numpy(decoded.samples.copy())
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

    # ---------------------------------------------------------------- the prompt's media runs
    def expand(self, ids: list[int], media: list[Clip | Media]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The template's ids with each media placeholder repeated to its token count, and the
        thinker's media inputs (``MEDIA_INPUTS``)."""
        audio, image = self.tokens.audio, self.vision.image_token_id
        clips = [m for m in media if isinstance(m, Clip)]
        images = [m for m in media if not isinstance(m, Clip)]
        counts = {audio: sum(1 for t in ids if t == audio), image: sum(1 for t in ids if t == image)}
        if counts[audio] != len(clips) or counts[image] != len(images):
            raise RequestError("messages", f"the prompt has {counts[audio]} audio and {counts[image]} image "
                                           f"placeholders for {len(clips)} clips and {len(images)} images "
                                           "(text may not contain them)")
        if self.tokens.video in ids:
            raise RequestError("messages", "the prompt holds a video placeholder; video input is not supported")
        merge = self.vision.spatial_merge_size ** 2
        queue = {audio: iter(c.tokens for c in clips), image: iter(m.grid[0] * m.grid[1] * m.grid[2] // merge
                                                                  for m in images)}
        out: list[int] = []
        for token in ids:
            out += [token] * next(queue[token]) if token in queue else [token]
        inputs = self.no_media()
        if clips:
            inputs["audio_mels"] = torch.cat([c.mel for c in clips], dim=1)
            inputs["audio_frames"] = torch.tensor([c.mel.shape[1] for c in clips], dtype=torch.int64)
        if images:
            inputs["pixel_values"] = torch.cat([m.patches for m in images])
            inputs["grid_thw"] = torch.tensor([m.grid for m in images], dtype=torch.int64)
            inputs["positions"], _ = image_positions(out, [m.grid for m in images], self.vision)
        return out, inputs

    def no_media(self) -> dict[str, torch.Tensor]:
        """Empty media inputs (every walk takes them)."""
        v = self.vision
        patch = 3 * v.temporal_patch_size * v.patch_size ** 2
        return {"audio_mels": torch.zeros(self.audio.num_mel_bins, 0),
                "audio_frames": torch.zeros(0, dtype=torch.int64),
                "pixel_values": torch.zeros(0, patch), "grid_thw": torch.zeros(0, 3, dtype=torch.int64),
                "positions": torch.zeros(3, 0, dtype=torch.int64)}
