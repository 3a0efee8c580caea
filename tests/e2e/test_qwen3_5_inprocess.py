"""Qwen3.5 through an in-process deployment (tiny config in the released layout, dummy
weights, a local tokenizer): concurrent greedy chats equal their solo results, and every
state slot and KV page comes back; startup refuses a concurrency the state pool cannot
hold; enable_thinking reaches the chat template."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from inprocess import poll_drained, record_batches
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer
from transformers import Qwen3_5Config as HFConfig

from mstar.config import ConfigError, parse_config
from mstar.contract import ChatSpec, GenerateSpec, RequestError, SamplingParams
from mstar.runtime.launch import Deployment, start

TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
QUESTIONS = ["What is the capital of France?", "hi", "Name three colours of the rainbow, please, in order."]
MAX_TOKENS = 10


def _tokenizer() -> Qwen2Tokenizer:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    merges = [("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("Ġ", "a")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>")
    tok.add_tokens(specials[1:], special_tokens=True)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_5_tiny")
    _tokenizer().save_pretrained(directory)
    text = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, eos_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
    config = HFConfig(text_config=text, vision_config=vision).to_dict()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return directory


def _config(checkpoint: Path, **overrides) -> dict:
    return {"model": "qwen3_5_0_8b", "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 256,
            "max_concurrent_requests": 4,
            "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}, "gdn_state": {"max_slots": 5}},
            "model_kwargs": {"seed": 3}} | overrides


@pytest.fixture(scope="module")
def deployment(checkpoint: Path) -> Iterator[Deployment]:
    d = start(parse_config(_config(checkpoint)), in_process=True)
    try:
        yield d
    finally:
        d.close()


def _engine(d: Deployment):
    return d.runtime.workers.workers[0].engines["llm"]


def _spec(question: str, tag: str) -> ChatSpec:
    return ChatSpec(request_id=f"{tag}-{uuid.uuid4().hex[:12]}", messages=[{"role": "user", "content": question}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS, ignore_eos=True)


async def _tokens(d: Deployment, spec: ChatSpec) -> tuple[list[int], str | None]:
    ids, reason = [], None
    events = d.backend.chat(spec)
    try:
        async for event in events:
            ids += event.token_ids
            reason = event.finish_reason or reason
    finally:
        await events.aclose()
    return ids, reason


def _assert_drained(d: Deployment) -> None:
    engine = _engine(d)
    poll_drained(d, engine, also=lambda: engine.forward.states.num_used == 0)
    assert engine.forward.states.num_used == 0, f"state slots still held by {engine.forward.states.request_ids()}"
    assert engine.pool.num_used_pages == 0 and engine.seqs == {}
    assert all(units == 0 for units in d.runtime.conductor.in_use.values()), d.runtime.conductor.in_use
    engine.forward.states.check_invariants()


def test_concurrent_chats_equal_solo_and_free_everything(deployment: Deployment) -> None:
    d = deployment
    assert d.runtime.conductor.capacity["state_slots"] == 4
    alone = [asyncio.run(_tokens(d, _spec(q, f"alone{i}"))) for i, q in enumerate(QUESTIONS)]
    for ids, reason in alone:
        assert len(ids) == MAX_TOKENS and reason == "length"
    assert len({tuple(ids) for ids, _ in alone}) > 1, "different prompts should give different tokens"
    _assert_drained(d)

    async def together():
        return await asyncio.wait_for(
            asyncio.gather(*(_tokens(d, _spec(q, f"batch{i}")) for i, q in enumerate(QUESTIONS))), timeout=120)

    with record_batches(_engine(d)) as rec:
        batched = asyncio.run(together())
    assert batched == alone
    assert max(len(b) for b in rec.batches) > 1, "the chats never shared a step"
    _assert_drained(d)


def test_enable_thinking_reaches_the_template(deployment: Deployment) -> None:
    spec = deployment.spec
    tok = spec.tokenizer
    think_end = tok.convert_tokens_to_ids("</think>")
    default = spec.prepare_generate(GenerateSpec("g1", "hi", [], ["text"], {}))
    off = spec.prepare_generate(GenerateSpec("g2", "hi", [], ["text"], {"enable_thinking": False}))
    assert think_end not in default.inputs["prompt_ids"].tolist()
    assert think_end in off.inputs["prompt_ids"].tolist()
    assert off.cost == {"kv_pages": off.cost["kv_pages"], "state_slots": 1}
    with pytest.raises(RequestError) as err:
        spec.prepare_generate(GenerateSpec("g3", "hi", [], ["text"], {"enable_thinking": "no"}))
    assert err.value.field == "enable_thinking"
    assert sorted(spec.stop_token_ids) == [0, 2]


def test_startup_refuses_a_pool_smaller_than_the_concurrency(checkpoint: Path) -> None:
    config = parse_config(_config(checkpoint, max_concurrent_requests=5))
    with pytest.raises(ConfigError, match=r"resources\.gdn_state\.max_slots.*max_concurrent_requests"):
        start(config, in_process=True)


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[2].glob("configs/qwen3_5*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_configs_hold_their_concurrency(path: Path) -> None:
    from mstar.config import load_config
    from mstar.model.registry import model_class

    config = load_config(path)
    capacity = model_class(config.model)(config).default_capacity()
    assert capacity["state_slots"] >= config.max_concurrent_requests
    assert capacity["kv_pages"] >= config.max_concurrent_requests
