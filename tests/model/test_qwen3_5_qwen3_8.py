"""Qwen3.8-27B is served by the Qwen3.5 class but refuses video (as documented): a video
part of a chat and an animated upload to ``/generate`` each get a RequestError naming the
field, before any decoding; images still go through, and Qwen3.5 keeps taking video."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import Qwen3_5Config as HFConfig

from mstar.config import parse_config
from mstar.contract import GenerateSpec, RequestError
from mstar.model.qwen3_5.checkpoint import Qwen3_5Checkpoint
from mstar.model.registry import model_class


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_8_tiny")
    text = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = HFConfig(text_config=text, vision_config=vision, image_token_id=5, video_token_id=6,
                      vision_start_token_id=3, vision_end_token_id=4).to_dict()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "fps": 2, "min_frames": 4, "max_frames": 8,
         "size": {"shortest_edge": 64, "longest_edge": 16 * 16 * 8}}))
    return directory


def _media(frames: int, fmt: str) -> bytes:
    rng = np.random.default_rng(frames)
    images = [Image.fromarray(rng.integers(0, 255, (20, 36, 3), dtype=np.uint8)) for _ in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format=fmt, save_all=frames > 1, append_images=images[1:], duration=250, loop=0)
    return buffer.getvalue()


def _spec(key: str, checkpoint: Path):
    spec = model_class(key)(parse_config({"model": key, "model_path": str(checkpoint)}))
    spec._load_media_settings(Qwen3_5Checkpoint.locate(str(checkpoint)))  # the frontend's media part
    return spec


def _messages(kind: str, data: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": kind, "data": data}]}]


def test_qwen3_8_refuses_video_and_takes_images(checkpoint: Path) -> None:
    spec = _spec("qwen3_8_27b", checkpoint)
    assert spec.input_modalities == {"text", "image"}  # the HTTP server refuses video_url parts itself
    with pytest.raises(RequestError, match="does not take videos") as err:
        spec._split_media(_messages("video", _media(4, "GIF")))
    assert err.value.field == "messages[0].content[1]"
    with pytest.raises(RequestError, match="animated image is a video") as err:
        spec.prepare_generate(GenerateSpec("g", "describe", [("clip.gif", _media(4, "GIF"))], ["text"], {}))
    assert err.value.field == "files"
    _, media = spec._split_media(_messages("image", _media(1, "PNG")))
    assert len(media) == 1


def test_qwen3_5_still_takes_video(checkpoint: Path) -> None:
    spec = _spec("qwen3_5_27b", checkpoint)
    assert "video" in spec.input_modalities
    _, media = spec._split_media(_messages("video", _media(4, "GIF")))
    assert len(media) == 1
