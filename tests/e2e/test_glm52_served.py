"""GLM-5.2 served: a tiny checkpoint folder in the released layout (transformers' config with
the MTP and fp8 fields, a byte-level tokenizer with a chat template), dummy weights, the
in-process runtime under uvicorn, and the official ``openai`` client. Chats and completions
run over the latent paged cache; concurrent requests equal their solo results (greedy, the
indexer dropping keys: prompts are longer than ``index_topk``); the KV pages all come back;
a prompt plus ``max_tokens`` over ``max_seq_len`` is a 400 naming ``max_tokens``."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_server import Uvicorn
from tokenizers.pre_tokenizers import ByteLevel
from transformers import GlmMoeDsaConfig, Qwen2Tokenizer

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support import chat_http
from tests.support.glm52 import TINY

MODEL = "glm52"
MAX_TOKENS = 6
SPECIALS = ["<|endoftext|>", "[gMASK]", "<|user|>", "<|assistant|>"]
TEMPLATE = ("[gMASK]{%- for message in messages %}{{- '<|' + message.role + '|>' + message.content }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}")


def write_checkpoint(directory: Path) -> Path:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|endoftext|>")
    tok.add_tokens(SPECIALS[1:], special_tokens=True)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    config = GlmMoeDsaConfig(**{**TINY, "vocab_size": 272, "index_topk": 8}).to_dict()
    config.update(num_nextn_predict_layers=1, quantization_config={"quant_method": "fp8",
                                                                   "weight_block_size": [128, 128]})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("glm52_tiny"))
    deployment = start(parse_config({
        "model": MODEL, "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 128,
        "max_concurrent_requests": 4, "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 8}},
        "model_kwargs": {"seed": 3},
    }), in_process=True)
    try:
        with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
            yield live
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def kv_pages_used(server: Uvicorn) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(r'^mstar_kv_pages_used\{[^}]*node="llm"[^}]*\} (\S+)$', text, re.M).group(1))


def test_chat_completions(oai: openai.OpenAI) -> None:
    question = "Name the capital of France, please."
    result = chat_http.ask(oai, MODEL, question, MAX_TOKENS)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == MAX_TOKENS
    assert result.usage.prompt_tokens == 3 + len(question)  # [gMASK], <|user|>, <|assistant|>: one byte a token


def test_concurrent_requests_equal_solo_and_pages_return(oai: openai.OpenAI, server: Uvicorn) -> None:
    contents = ["hi", "What is the tallest mountain on Earth?", "Count: one two three four five six seven."]
    chat_http.check_concurrent_equals_solo(oai, MODEL, contents, MAX_TOKENS)
    deadline = time.monotonic() + 10
    while kv_pages_used(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_pages_used(server) == 0


def test_completion_and_budget_error(oai: openai.OpenAI) -> None:
    result = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == MAX_TOKENS
    with pytest.raises(openai.BadRequestError) as info:
        chat_http.ask(oai, MODEL, "hi", 200)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
