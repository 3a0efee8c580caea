"""The Cosmos3-Edge reasoner behind the HTTP app on the CPU: a tiny ``cosmos3_edge`` deployment
(the model tests' layout with an Edge tower and a ``reasoner/`` folder, ``load_format: dummy``).
The official ``openai`` client's chat with an image part and with a video part (data URIs)
answers, streamed and not (the same greedy text); concurrent chats equal their solo answers
(they share decode steps); bad parts are 400s naming the part; the generation routes still
answer on the same tower."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from live_server import Uvicorn
from PIL import Image

from mstar.config import parse_config
from mstar.media.video import encode_mp4
from mstar.runtime.launch import start
from mstar.server.app import create_app

pytest.importorskip("diffusers")

MODEL = "cosmos3_edge"
EDGE = dict(hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-6)
REASONER = {"vision_config": {"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "patch_size": 16, "num_patches": 16,
                              "spatial_merge_size": 2},
            "projector_hidden_size": 36}


def write_tiny_edge(root: Path) -> Path:
    path = Path(__file__).parents[1] / "model" / "cosmos3" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_cosmos3_tiny_edge", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer

    tok = module.tokenizer()
    tok.add_tokens(["<|vision_end|>", "<|image_pad|>", "<|video_pad|>"], special_tokens=True)
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    module.write_checkpoint(root, Cosmos3OmniTransformer(vocab_size=len(tok), **{**module.TOWER, **EDGE}),
                            AutoencoderKLWan(**module.VAE), tok)
    for weights in root.glob("*/*.safetensors"):
        weights.unlink()
    (root / "reasoner").mkdir()
    (root / "reasoner" / "config.json").write_text(json.dumps({**REASONER, **ids}))
    return root


@pytest.fixture(scope="module")
def oai(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = write_tiny_edge(tmp_path_factory.mktemp("cosmos3-edge-tiny"))
    knobs = {"max_image_area": 256 * 256, "num_inference_steps": 2, "reasoner_max_images": 2,
             "reasoner_max_image_pixels": 256 * 256}
    deployment = start(parse_config({"model": MODEL, "model_path": str(root), "load_format": "dummy",
                                     "max_concurrent_requests": 8, "max_seq_len": 512,
                                     "model_kwargs": knobs}), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        deployment.close()


def png(seed: int, width: int = 40, height: int = 56) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def mp4(seed: int, frames: int = 6) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (frames, 32, 32, 3), dtype=np.uint8)
    return "data:video/mp4;base64," + base64.b64encode(encode_mp4(pixels, fps=4)).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def chat(oai: openai.OpenAI, content, stream: bool = False, max_tokens: int = 6) -> str:
    messages = [{"role": "user", "content": content}]
    if not stream:
        result = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
        assert result.choices[0].finish_reason in ("stop", "length")
        return result.choices[0].message.content
    chunks = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                         stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


CHATS = {
    "image": [image_part(png(1)), {"type": "text", "text": "what is this"}],
    "video": [video_part(mp4(2)), {"type": "text", "text": "what happens"}],
    "two_images": [image_part(png(3, 64, 32)), image_part(png(4)), {"type": "text", "text": "compare"}],
    "text": "hi cat",
}


def test_chat_streamed_and_not(oai: openai.OpenAI) -> None:
    for name, content in CHATS.items():
        whole = chat(oai, content)
        assert isinstance(whole, str), name
        assert chat(oai, content, stream=True) == whole, name


def test_concurrent_chats_equal_their_solo_answers(oai: openai.OpenAI) -> None:
    solo = {name: chat(oai, content, max_tokens=10) for name, content in CHATS.items()}
    assert all(solo.values()), solo  # the dummy tower answers some text for each
    with ThreadPoolExecutor(8) as pool:
        futures = [(name, pool.submit(chat, oai, content, False, 10)) for name, content in [*CHATS.items()] * 2]
        together = [(name, future.result()) for name, future in futures]
    assert together == [(name, solo[name]) for name, _ in futures]


def test_image_changes_the_answer_logits(oai: openai.OpenAI) -> None:
    """Different images give different prompts to the tower (their embeddings are read)."""
    answers = {chat(oai, [image_part(png(seed)), {"type": "text", "text": "x"}], max_tokens=12)
               for seed in range(4)}
    assert len(answers) > 1


@pytest.mark.parametrize("content, param", [
    ([image_part(png(1)), image_part(png(2)), image_part(png(3))], "messages[0].content[2]"),  # > 2 images
    ([image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())], "messages[0].content[0]"),
    ([video_part("data:video/mp4;base64," + base64.b64encode(b"not an mp4").decode())], "messages[0].content[0]"),
    ([image_part(png(1, 300, 300))], "messages[0].content[0]"),  # over reasoner_max_image_pixels
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], "messages[0].content[0]"),
])
def test_bad_parts_are_400_naming_them(oai: openai.OpenAI, content: list, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, content)
    assert err.value.body["param"] == param, err.value.body


def test_generation_still_served(oai: openai.OpenAI) -> None:
    result = oai.images.generate(model=MODEL, prompt="a red cube", size="256x256", response_format="b64_json",
                                 extra_body={"seed": 1})
    assert Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).size == (256, 256)


def test_thinking_switch_and_sampling_knobs(oai: openai.OpenAI) -> None:
    """``enable_thinking: false`` (extra body or ``chat_template_kwargs``) closes the template's
    think block in the prompt; ``top_k`` and ``repetition_penalty`` are taken."""
    messages = [{"role": "user", "content": [image_part(png(5)), {"type": "text", "text": "plan"}]}]

    def prompt_tokens(**extra) -> int:
        result = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                             extra_body=extra)
        return result.usage.prompt_tokens

    base = prompt_tokens()
    assert prompt_tokens(enable_thinking=False) > base
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > base
    assert prompt_tokens(top_k=5, repetition_penalty=1.2) == base
