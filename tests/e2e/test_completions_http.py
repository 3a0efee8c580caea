"""/v1/completions on a real SmolLM2 (embedded weights, the in-process runtime under uvicorn
in a thread), driven by the official ``openai`` client's ``completions.create``: a greedy
completion is the prompt's continuation from the engine itself (no chat template), token-id
prompts equal their text, concurrent requests equal their solo results, echo and stop
strings behave as OpenAI's, bad input is a 400 naming the field, and a client that leaves
mid-stream gives every KV page back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from inprocess import deployed, poll_drained
from live_server import Uvicorn

from mstar.contract import GenerateSpec
from mstar.runtime.launch import Deployment
from mstar.server.app import create_app

MODEL = "smollm2"
MAX_SEQ_LEN = 256
MAX_TOKENS = 8
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite fruit is",
]


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    with deployed({"model": MODEL, "max_seq_len": MAX_SEQ_LEN, "max_concurrent_requests": 16,
                   "resources": {"kv_cache": {"max_num_pages": 256, "page_size": 16}}}) as d:
        yield d


@pytest.fixture(scope="module")
def server(deployment: Deployment) -> Iterator[Uvicorn]:
    with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
        yield live


@pytest.fixture(scope="module")
def oai(server: Uvicorn) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(oai: openai.OpenAI, prompt, **extra):
    extra.setdefault("max_tokens", MAX_TOKENS)
    return oai.completions.create(model=MODEL, prompt=prompt, temperature=0, **extra)


def engine_continuation(deployment: Deployment, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    """The engine's greedy continuation of ``prompt`` taken as it is (/generate's ``chat:
    false``), straight from the in-process backend: no HTTP, no completions route."""

    async def run() -> tuple[str, list[int]]:
        spec = GenerateSpec(f"ref-{uuid.uuid4().hex}", prompt, [], ["text"],
                            {"chat": False, "temperature": 0, "max_tokens": max_tokens})
        text, ids = [], []
        async for event in deployment.backend.generate(spec):
            assert event.error is None, event.error
            text.append(event.text)
            ids += event.token_ids
        return "".join(text), ids

    return asyncio.run(run())


def test_greedy_completion_is_the_engines_continuation(oai: openai.OpenAI, deployment: Deployment) -> None:
    tokenizer = deployment.spec.tokenizer
    for prompt in PROMPTS[:1]:
        # SmolLM2's tokenizer adds no special tokens: the route's default (add them) is the same prompt
        assert tokenizer.encode(prompt) == tokenizer.encode(prompt, add_special_tokens=False)
        expected, ids = engine_continuation(deployment, prompt, MAX_TOKENS)
        result = complete(oai, prompt)
        choice = result.choices[0]
        assert result.object == "text_completion" and result.id.startswith("cmpl-")
        assert choice.text == expected and choice.text.strip()
        assert choice.finish_reason == ("length" if len(ids) == MAX_TOKENS else "stop")
        assert result.usage.completion_tokens == len(ids)
        assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
    # the chat template is not applied: the same text as a chat answers otherwise
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       temperature=0, max_tokens=MAX_TOKENS)
    assert chat.usage.prompt_tokens > len(tokenizer.encode(PROMPTS[0]))


def test_token_id_prompts_equal_their_text(oai: openai.OpenAI, deployment: Deployment) -> None:
    ids = deployment.spec.tokenizer.encode(PROMPTS[2])
    text = complete(oai, PROMPTS[2]).choices[0].text
    assert complete(oai, ids).choices[0].text == text
    assert complete(oai, [ids]).choices[0].text == text  # a list of one prompt, as genai-perf sends


def test_streaming_equals_plain(oai: openai.OpenAI) -> None:
    plain = complete(oai, PROMPTS[3], extra_body={"ignore_eos": True})
    chunks = list(complete(oai, PROMPTS[3], stream=True, stream_options={"include_usage": True},
                           extra_body={"ignore_eos": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS == plain.usage.completion_tokens


def test_max_tokens_defaults_to_16(oai: openai.OpenAI) -> None:
    result = oai.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 16 and result.choices[0].finish_reason == "length"


def test_concurrent_requests_equal_solo(oai: openai.OpenAI) -> None:
    def answer(prompt: str) -> str:
        return complete(oai, prompt, extra_body={"ignore_eos": True}).choices[0].text

    prompts = PROMPTS[2:]
    alone = [answer(p) for p in prompts]
    assert len(set(alone)) == len(prompts)
    with ThreadPoolExecutor(len(prompts) * 2) as pool:
        together = list(pool.map(answer, prompts * 2))
    assert together == alone * 2


def test_echo(oai: openai.OpenAI, deployment: Deployment) -> None:
    plain = complete(oai, PROMPTS[0]).choices[0].text
    assert complete(oai, PROMPTS[0], echo=True).choices[0].text == PROMPTS[0] + plain
    chunks = [c for c in complete(oai, PROMPTS[0], echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text == PROMPTS[0]  # the prompt goes first, on its own
    assert "".join(c.choices[0].text for c in chunks[1:]) == plain
    ids = deployment.spec.tokenizer.encode(PROMPTS[0])  # token ids echo as their text
    assert complete(oai, ids, echo=True).choices[0].text == PROMPTS[0] + plain


def test_stop_strings(oai: openai.OpenAI) -> None:
    full = complete(oai, PROMPTS[1], max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    word = full.split()[len(full.split()) // 2]
    expected = full[:full.index(word)]
    result = complete(oai, PROMPTS[1], max_tokens=16, stop=[word, "never-there"], extra_body={"ignore_eos": True})
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected, "stop")
    chunks = list(complete(oai, PROMPTS[1], max_tokens=16, stop=word, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt": list(range(MAX_SEQ_LEN + 1))}, "prompt"),
    ({"prompt": [1, 2, 10**7]}, "prompt[2]"),
    ({"prompt": "hi", "max_tokens": MAX_SEQ_LEN}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": MAX_SEQ_LEN + 1}, "max_tokens"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "hi", "logprobs": 1}, "logprobs"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "temperature": 5}, "temperature"),
    ({"prompt": "hi", "extra_body": {"top_k": -3}}, "top_k"),
])
def test_bad_requests_name_the_field(oai: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, **extra)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def test_client_leaving_mid_stream_frees_the_request(server: Uvicorn, deployment: Deployment,
                                                     oai: openai.OpenAI) -> None:
    engine = deployment.runtime.workers.workers[0].engines["llm"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data:"))
        assert engine.pool.num_used_pages > 0  # it is decoding
    poll_drained(deployment, engine)
    assert engine.pool.num_used_pages == 0 and not deployment.runtime.tracked
    assert complete(oai, PROMPTS[0]).choices[0].text.strip()
