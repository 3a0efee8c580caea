"""Nemotron-H served on the CPU: a tiny checkpoint folder (transformers' Nemotron-H config, a
byte-level tokenizer with a chat template), dummy weights, the in-process runtime under
uvicorn in a thread, and the official ``openai`` client. Chats and text completions answer;
concurrent chats equal their solo answers; a streamed chat the client abandons gives back its
state slot and pages; startup refuses a concurrency the state pool cannot hold, naming it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from inprocess import record_batches
from live_server import Uvicorn
from tokenizers.pre_tokenizers import ByteLevel
from transformers import NemotronHConfig as HFConfig
from transformers import Qwen2Tokenizer

from mstar.config import ConfigError, parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.support import chat_http

MODEL = "nemotron_h"
MAX_TOKENS = 6
SPECIALS = ["<unk>", "<s>", "</s>", "<extra_id_0>", "<extra_id_1>"]
TEMPLATE = (
    "{%- for message in messages %}{{- '<extra_id_0>' + message.role + '\\n' + message.content + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<extra_id_1>assistant\\n' }}{%- endif %}"
)


def _tokenizer() -> Qwen2Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="</s>")
    tok.add_tokens(SPECIALS[3:], special_tokens=True)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("nemotron_h_tiny")
    _tokenizer().save_pretrained(directory)
    config = HFConfig(vocab_size=272, hidden_size=32, hybrid_override_pattern="M*-M-", num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
                      n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16, eos_token_id=2)
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return directory


def _config(checkpoint: Path, **overrides) -> dict:
    return {"model": MODEL, "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 256,
            "max_concurrent_requests": 4,
            "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}, "mamba_state": {"max_slots": 5}},
            "model_kwargs": {"seed": 3}} | overrides


@pytest.fixture(scope="module")
def deployment(checkpoint: Path):
    d = start(parse_config(_config(checkpoint)), in_process=True)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def oai(deployment) -> Iterator[openai.OpenAI]:
    with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _engine(deployment):
    return deployment.runtime.workers.workers[0].engines["llm"]


def _wait_until(condition, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _drained(deployment) -> bool:
    engine = _engine(deployment)
    return (engine.forward.states.num_used == 0 and engine.pool.num_used_pages == 0 and not engine.seqs
            and deployment.runtime.conductor.idle and not deployment.runtime.tracked)


def test_chat_and_completion(deployment, oai: openai.OpenAI) -> None:
    assert deployment.runtime.conductor.capacity["state_slots"] == 4
    result = chat_http.ask(oai, MODEL, "hello there", MAX_TOKENS)
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == MAX_TOKENS
    completion = oai.completions.create(model=MODEL, prompt="plain text", max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == MAX_TOKENS
    assert completion.usage.prompt_tokens == len("plain text")  # byte-level, no template
    assert _wait_until(lambda: _drained(deployment))


def test_concurrent_chats_equal_solo(deployment, oai: openai.OpenAI) -> None:
    chat_http.check_concurrent_equals_solo(oai, MODEL, ["What is the capital of France?", "hi", "colours, please"],
                                           MAX_TOKENS, streamed=1)
    assert _wait_until(lambda: _drained(deployment))
    _engine(deployment).forward.states.check_invariants()


def test_cancelled_stream_frees_its_slot(deployment, oai: openai.OpenAI) -> None:
    """A client that stops reading a long streamed chat and closes it: its state slot and KV
    pages come back, and the server goes on serving."""
    engine = _engine(deployment)
    with record_batches(engine) as rec:
        stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tell me a story"}],
                                             max_tokens=200, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        assert engine.forward.states.num_used == 1  # decoding, its slot held
        stream.close()
        assert _wait_until(lambda: _drained(deployment)), \
            f"still held: slots {engine.forward.states.request_ids()}, pages {engine.pool.num_used_pages}"
    steps = sum(1 for batch in rec.batches for _, op in batch if op == "decode")
    assert steps < 150, f"the request ran {steps} decode steps: it finished rather than being cancelled"
    engine.forward.states.check_invariants()
    assert chat_http.ask(oai, MODEL, "still there?", MAX_TOKENS).usage.completion_tokens == MAX_TOKENS


def test_startup_refuses_a_pool_smaller_than_the_concurrency(checkpoint: Path) -> None:
    config = parse_config(_config(checkpoint, max_concurrent_requests=5))
    with pytest.raises(ConfigError, match=r"resources\.mamba_state\.max_slots.*max_concurrent_requests"):
        start(config, in_process=True)


def test_shipped_config_holds_its_concurrency() -> None:
    from mstar.config import load_config
    from mstar.model.registry import model_class

    config = load_config(Path(__file__).parents[2] / "configs" / "nemotron_h.yaml")
    capacity = model_class(config.model)(config).default_capacity()
    assert capacity["state_slots"] >= config.max_concurrent_requests
    assert capacity["kv_pages"] >= config.max_concurrent_requests
