"""Qwen3.5 with images and video through an in-process deployment (tiny multimodal config,
dummy weights, a local tokenizer): concurrent chats with media return what each returns
alone, their media share vision forwards, everything is freed; media over the budgets or
undecodable get a RequestError naming the part."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from inprocess import poll_drained, record_batches
from PIL import Image
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer
from transformers import Qwen3_5Config as HFConfig

from mstar.config import parse_config
from mstar.contract import ChatSpec, RequestError, SamplingParams
from mstar.runtime.launch import Deployment, start

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_TOKENS = 6


def _tokenizer() -> Qwen2Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>")
    tok.add_tokens(SPECIALS[1:], special_tokens=True)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_5_vl_tiny")
    _tokenizer().save_pretrained(directory)
    text = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = HFConfig(text_config=text, vision_config=vision, image_token_id=5, video_token_id=6,
                      vision_start_token_id=3, vision_end_token_id=4).to_dict()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "size": {"shortest_edge": 64,
                                                                              "longest_edge": 32 * 32}}))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "fps": 2, "min_frames": 4, "max_frames": 8,
         "size": {"shortest_edge": 64, "longest_edge": 16 * 16 * 8}}))
    return directory


@pytest.fixture(scope="module")
def deployment(checkpoint: Path) -> Iterator[Deployment]:
    config = {"model": "qwen3_5_0_8b", "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 512,
              "max_concurrent_requests": 4,
              "resources": {"kv_cache": {"max_num_pages": 128, "page_size": 16}, "gdn_state": {"max_slots": 5}},
              "model_kwargs": {"seed": 3, "max_image_pixels": 200 * 200, "max_video_pixels": 4 * 64 * 64}}
    d = start(parse_config(config), in_process=True)
    try:
        yield d
    finally:
        d.close()


def _png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _gif(seed: int, frames: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=250, loop=0)
    return buffer.getvalue()


def _spec(content, tag: str) -> ChatSpec:
    return ChatSpec(request_id=f"{tag}-{uuid.uuid4().hex[:12]}", messages=[{"role": "user", "content": content}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS, ignore_eos=True)


CONTENTS = [
    [{"type": "text", "text": "what is this?"}, {"type": "image", "data": _png(1, (40, 28))}],
    [{"type": "image", "data": _png(2, (24, 60))}, {"type": "text", "text": "and"},
     {"type": "image", "data": _png(3, (32, 32))}],
    [{"type": "text", "text": "watch"}, {"type": "video", "data": _gif(4, 6, (36, 20))}, {"type": "text", "text": "!"}],
    "plain text",
]


async def _tokens(d: Deployment, spec: ChatSpec) -> list[int]:
    ids = []
    events = d.backend.chat(spec)
    try:
        async for event in events:
            ids += event.token_ids
    finally:
        await events.aclose()
    return ids


def test_concurrent_media_chats_equal_solo(deployment: Deployment) -> None:
    d = deployment
    engines = d.runtime.workers.workers[0].engines
    request = d.spec.prepare_chat(_spec(CONTENTS[2], "probe"))
    assert request.walk == "chat_vision" and request.inputs["grid_thw"].shape == (1, 3)
    assert d.spec.prepare_chat(_spec(CONTENTS[3], "probe")).walk == "chat"
    alone = [asyncio.run(_tokens(d, _spec(c, f"alone{i}"))) for i, c in enumerate(CONTENTS)]
    assert all(len(ids) == MAX_TOKENS for ids in alone)
    assert len({tuple(ids) for ids in alone}) > 1

    async def together():
        return await asyncio.wait_for(asyncio.gather(*(_tokens(d, _spec(c, f"batch{i}"))
                                                       for i, c in enumerate(CONTENTS))), timeout=120)

    # Whether the media reach the conductor together depends on the machine's load (each is
    # prepared on a thread of its own): up to three tries for them to share a vision forward.
    shared = False
    for _ in range(3):
        with record_batches(engines["vision"]) as rec:
            batched = asyncio.run(together())
        assert batched == alone
        shared = max(len(b) for b in rec.batches) > 1
        if shared:
            break
    assert shared, "the media never shared a vision forward"
    llm = engines["llm"]
    poll_drained(d, llm, also=lambda: llm.forward.states.num_used == 0)
    assert llm.forward.states.num_used == 0 and llm.pool.num_used_pages == 0 and llm.forward.rope_deltas == {}


@pytest.mark.parametrize("content,rule", [
    ([{"type": "image", "data": _png(5, (300, 300))}], "max_image_pixels"),
    ([{"type": "image", "data": b"\x89PNG\r\n\x1a\nbroken"}], "cannot decode the image"),
    ([{"type": "text", "text": "x"}, {"type": "video", "data": _gif(6, 8, (80, 80))}], "max_video_pixels"),
    ([{"type": "audio", "data": b""}], "unknown content part type"),
    ([{"type": "text", "text": "<|image_pad|>"}], "placeholder"),
])
def test_bad_media_is_a_request_error(deployment: Deployment, content, rule: str) -> None:
    with pytest.raises(RequestError, match=rule) as err:
        deployment.spec.prepare_chat(_spec(content, "bad"))
    assert err.value.field.startswith("messages")
