"""Qwen3.5 with images and video through the HTTP server on the CPU: a tiny multimodal
checkpoint folder (transformers' Qwen3.5 config with a vision tower, a byte-level tokenizer
whose chat template honours ``enable_thinking``, image and video preprocessor configs),
dummy weights, the in-process runtime under uvicorn in a thread, and the official ``openai``
client sending ``image_url`` / ``video_url`` parts as data URIs. Concurrent requests return
what each returns alone (greedy); an image over the pixel budget, a broken data URI and a
video over the pixel budget each get a 4xx naming the part."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from live_server import Uvicorn
from PIL import Image
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer
from transformers import Qwen3_5Config as HFConfig

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support import chat_http
from tests.support.chat_http import image, png_uri, text

MODEL = "qwen3_5_0_8b"
MAX_TOKENS = 5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
# Qwen3.5's layout in small: media parts become placeholders where they were written, and
# the assistant turn opens a <think> block unless enable_thinking is false (then it is empty).
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def _tokenizer() -> Qwen2Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>")
    tok.add_tokens(SPECIALS[1:], special_tokens=True)
    tok.chat_template = TEMPLATE
    return tok


def write_checkpoint(directory: Path) -> Path:
    _tokenizer().save_pretrained(directory)
    text = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = HFConfig(text_config=text, vision_config=vision, image_token_id=5, video_token_id=6,
                      vision_start_token_id=3, vision_end_token_id=4)
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    (directory / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
         "size": {"shortest_edge": 64, "longest_edge": 32 * 32}}))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "fps": 2, "min_frames": 4, "max_frames": 8,
         "size": {"shortest_edge": 64, "longest_edge": 16 * 16 * 8}}))
    return directory




def gif_uri(seed: int, frames: int, size: tuple[int, int]) -> str:
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=250, loop=0)
    return "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()




def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}




@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("qwen3_5_http"))
    deployment = start(parse_config({
        "model": MODEL, "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 512,
        "max_concurrent_requests": 4,
        "resources": {"kv_cache": {"max_num_pages": 128, "page_size": 16}, "gdn_state": {"max_slots": 5}},
        "model_kwargs": {"seed": 3, "max_image_pixels": 200 * 200, "max_video_pixels": 4 * 64 * 64},
    }), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(oai: openai.OpenAI, content: list[dict] | str, **extra: object):
    return chat_http.ask(oai, MODEL, content, MAX_TOKENS, **extra)


CONTENTS = [
    [text("what is this?"), image(png_uri(1, (40, 28)))],
    [text("watch"), video(gif_uri(4, 6, (36, 20))), text("!")],
    [image(png_uri(2, (24, 60))), text("and"), image(png_uri(3, (32, 32)))],
    "plain text",
]


def test_image_and_video_chats(oai: openai.OpenAI) -> None:
    plain = ask(oai, [text("what is this?")])
    with_image = ask(oai, CONTENTS[0])
    with_video = ask(oai, CONTENTS[1])
    for result in (plain, with_image, with_video):
        assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == MAX_TOKENS
    # the media became placeholder runs in the prompt: more prompt tokens than the text alone
    assert with_image.usage.prompt_tokens > plain.usage.prompt_tokens + 3
    assert with_video.usage.prompt_tokens > ask(oai, [text("watch!")]).usage.prompt_tokens + 3


def test_enable_thinking_reaches_the_template(oai: openai.OpenAI) -> None:
    default = ask(oai, CONTENTS[0]).usage.prompt_tokens
    closed = ask(oai, CONTENTS[0], enable_thinking=False).usage.prompt_tokens
    nested = ask(oai, CONTENTS[0], chat_template_kwargs={"enable_thinking": False}).usage.prompt_tokens
    assert closed == nested == default + len("\n</think>\n\n")  # "<think>\n" became "<think>\n\n</think>\n\n"
    assert ask(oai, CONTENTS[0], enable_thinking=True).usage.prompt_tokens == default


def test_concurrent_requests_equal_solo(oai: openai.OpenAI) -> None:
    chat_http.check_concurrent_equals_solo(oai, MODEL, CONTENTS, MAX_TOKENS, streamed=0)


@pytest.mark.parametrize(("content", "param", "rule"), [
    ([text("x"), image(png_uri(5, (300, 300)))], "messages[0].content[1]", "max_image_pixels"),
    ([text("x"), image("data:image/png;base64,iVBORw0KGgoAAAAN")], "messages[0].content[1]", "cannot decode"),
    ([image("data:image/png;base64,%%%")], "messages[0].content[0].image_url.url", "neither a data URI"),
    ([text("x"), video(gif_uri(6, 8, (80, 80)))], "messages[0].content[1]", "max_video_pixels"),
    ([video("https://example.com/clip.gif")], "messages[0].content[0].video_url.url", "MSTAR_ALLOW_REMOTE"),
])
def test_bad_media_is_a_4xx_naming_the_part(oai: openai.OpenAI, monkeypatch: pytest.MonkeyPatch,
                                            content: list[dict], param: str, rule: str) -> None:
    monkeypatch.delenv("MSTAR_ALLOW_REMOTE", raising=False)
    with pytest.raises(openai.BadRequestError) as info:
        ask(oai, content)
    error = info.value.body
    assert error["param"] == param and rule in error["message"], error  # type: ignore[index]
    assert ask(oai, "still serving").usage.completion_tokens == MAX_TOKENS


def test_text_completion_walks_the_text_path(oai: openai.OpenAI) -> None:
    """/v1/completions continues raw text on the hybrid model (its state slot and all); a
    prompt holding an image placeholder token has no image to fill it: a 400 naming it."""
    result = oai.completions.create(model=MODEL, prompt="plain text", max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == MAX_TOKENS
    assert result.usage.prompt_tokens == len("plain text")  # the byte-level tokenizer, no template
    ids = oai.completions.create(model=MODEL, prompt=_tokenizer().encode("plain text"),
                                 max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == result.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=[10, 5, 11], max_tokens=2)  # 5: <|image_pad|>
    assert info.value.body["param"] == "prompt" and "placeholder" in info.value.body["message"]  # type: ignore[index]
