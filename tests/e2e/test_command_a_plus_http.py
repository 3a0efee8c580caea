"""Command A+ through the HTTP server on the CPU: a tiny vision-language checkpoint folder
(transformers' Cohere2Vision model over a Cohere2-MoE decoder with a sliding window of 8,
saved with random weights large enough that greedy answers depend on the prompt; a byte-level
tokenizer with the image tokens and a chat template), the
in-process runtime under uvicorn in a thread, and the official ``openai`` client. Text and
image chats answer, concurrent requests answer as they do alone (greedy), a prompt plus
``max_tokens`` over ``max_seq_len`` is a 400 naming ``max_tokens``, every KV page (the
sliding-window pool's too) is back after; a request sending no sampling options gets the
release's defaults; a missing checkpoint is never downloaded."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from live_server import Uvicorn
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration, Qwen2Tokenizer

from mstar.config import parse_config
from mstar.contract import ChatSpec, GenerateSpec, RequestError, SamplingParams
from mstar.model.registry import model_class
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support import chat_http
from tests.support.chat_http import image, png_uri, text

MODEL = "command_a_plus"
MAX_TOKENS = 12  # prompts of ~40 tokens run past the window of 8
MAX_SEQ_LEN = 256
SPECIALS = ["<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>", "<|START_OF_IMG|>", "<|END_OF_IMG|>",
            "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
TEMPLATE = (
    "{{- '<BOS_TOKEN>' }}{%- for message in messages %}{{- '<|START_OF_TURN_TOKEN|>' + message.role + ': ' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|IMG_PATCH|>' }}{%- else %}{{- part.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '<|END_OF_TURN_TOKEN|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|>assistant: ' }}{%- endif %}"
)


def write_checkpoint(directory: Path) -> Path:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|END_OF_TURN_TOKEN|>")
    tok.add_tokens(SPECIALS, special_tokens=True)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    text_config = dict(model_type="cohere2_moe", vocab_size=272, hidden_size=64, intermediate_size=32,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=3, num_shared_experts=1, sliding_window=8,
                       max_position_embeddings=512, eos_token_id=1, bos_token_id=0, pad_token_id=1)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=4, image_size=32, patch_size=8)
    config = Cohere2VisionConfig(text_config=text_config, vision_config=vision, image_token_id=SPECIALS.index(
        "<|IMG_PATCH|>"), alignment_intermediate_size=64)
    torch.manual_seed(0)
    model = Cohere2VisionForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


def deployment_config(checkpoint: Path) -> dict:
    return {"model": MODEL, "model_path": str(checkpoint), "max_seq_len": MAX_SEQ_LEN, "dtype": "float32",
            "max_concurrent_requests": 4, "resources": {"kv_cache": {"max_num_pages": 96, "page_size": 4}},
            "model_kwargs": {"seed": 3}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("command_a_plus_http"))


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[tuple[Uvicorn, object]]:
    deployment = start(parse_config(deployment_config(checkpoint)), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live, deployment
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(oai: openai.OpenAI, content: list[dict] | str, **extra: object):
    return chat_http.ask(oai, MODEL, content, MAX_TOKENS, **extra)


CONTENTS = [
    [text("what is in this picture, please?"), image(png_uri(1, (90, 30)))],
    [image(png_uri(2, (40, 40))), text("and this one?")],
    "tell me something about mixtures of experts",
]


def test_text_and_image_chats(oai: openai.OpenAI) -> None:
    plain = ask(oai, [text("what is in this picture, please?")])
    with_image = ask(oai, CONTENTS[0])
    # the image: <BOI>, 3 x 1 tiles and the thumbnail of (4 tokens + a line break), <EOI>
    assert with_image.usage.prompt_tokens == plain.usage.prompt_tokens + 2 + 4 * 5
    assert with_image.usage.completion_tokens == MAX_TOKENS
    assert with_image.choices[0].message.content != plain.choices[0].message.content


def test_concurrent_requests_equal_solo(oai: openai.OpenAI) -> None:
    chat_http.check_concurrent_equals_solo(oai, MODEL, CONTENTS, MAX_TOKENS)


def test_prompt_plus_max_tokens_over_max_seq_len_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                    max_tokens=MAX_SEQ_LEN, temperature=0)
    assert "max_tokens" in str(info.value) and "max_seq_len" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        ask(oai, [text("two"), image("data:image/png;base64,AAAA")])
    assert "messages[0].content[1]" in str(info.value)


def test_every_page_is_back_after(oai: openai.OpenAI, served) -> None:
    ask(oai, CONTENTS[2])
    engine = served[1].runtime.workers.workers[0].engines["llm"]
    deadline = time.monotonic() + 10
    while engine.pool.num_used_pages or engine.pool.windowed.num_used_pages:
        assert time.monotonic() < deadline, "KV pages still held"
        time.sleep(0.05)
    engine.pool.check_invariants()


def test_sampling_defaults_and_no_download(checkpoint: Path, tmp_path: Path) -> None:
    spec = model_class(MODEL)(parse_config(deployment_config(checkpoint)))
    spec.load_frontend()
    messages = [{"role": "user", "content": "hi"}]
    request = spec.prepare_chat(ChatSpec("a", messages, SamplingParams(), 4))
    assert request.params["sampling"] == {"temperature": 0.9, "top_p": 0.95, "top_k": 0, "min_p": 0.0,
                                          "repetition_penalty": 1.04, "seed": None}
    sent = spec.prepare_chat(ChatSpec("b", messages, SamplingParams(temperature=0.0), 4))
    assert sent.params["sampling"]["temperature"] == 0.0 and sent.params["sampling"]["repetition_penalty"] == 1.0
    upload = base64.b64decode(png_uri(5, (30, 30)).split(",", 1)[1])
    generate = spec.prepare_generate(GenerateSpec("c", "what is it?", [("a.png", upload)], ["text"],
                                                  {"top_p": 0.5, "max_tokens": 4}))
    assert generate.walk == "chat_image" and generate.inputs["pixel_values"].shape == (1, 3, 32, 32)
    assert generate.params["sampling"]["top_p"] == 0.5 and generate.params["sampling"]["temperature"] == 0.9
    with pytest.raises(RequestError, match="image token"):
        spec.prepare_chat(ChatSpec("d", [{"role": "user", "content": "<|IMG_PATCH|>"}], SamplingParams(), 4))
    absent = model_class(MODEL)(parse_config({**deployment_config(checkpoint), "model_path": str(tmp_path / "x")}))
    with pytest.raises(Exception, match="model_path.*never downloaded"):
        absent.load_frontend()
