"""Concurrency on a real (in-process) SmolLM2 deployment: batching must not change greedy
outputs, prefills must mix with decodes, and every KV page must come back, including
when clients walk away in the middle of a stream."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from inprocess import Recorder, poll_drained, record_batches

from mstar.config import parse_config
from mstar.contract import ChatSpec, OutputEvent, SamplingParams
from mstar.engine.autoregressive import AutoregressiveEngine
from mstar.runtime.launch import Deployment, start

CONFIG = {
    "model": "smollm2",
    "max_seq_len": 512,
    "max_concurrent_requests": 32,
    "resources": {"kv_cache": {"max_num_pages": 512, "page_size": 16}},
}
MAX_TOKENS = 24
QUESTIONS = [
    "Name the capital of France.",
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
    "Translate 'hello' into Spanish.",
    "What gas do plants absorb from the air?",
    "Give me one word that rhymes with cat.",
    "What is the boiling point of water in Celsius?",
    "Which ocean is the biggest?",
    "Describe the color of the sky on a clear day in one sentence.",
    "What is the opposite of hot?",
    "List three fruits.",
    "Why do birds migrate south for the winter? Answer briefly, please.",
]


@dataclass
class Outcome:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    events: int = 0

    def add(self, event: OutputEvent) -> None:
        self.events += 1
        self.text += event.text
        self.token_ids += event.token_ids
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        if event.finish_reason:
            self.finish_reason = event.finish_reason


def _engine(d: Deployment) -> AutoregressiveEngine:
    return d.runtime.workers.workers[0].engines["llm"]


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    d = start(parse_config(CONFIG), in_process=True)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def recorder(deployment: Deployment) -> Iterator[Recorder]:
    with record_batches(_engine(deployment)) as rec:
        yield rec


def _spec(question: str, tag: str, max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> ChatSpec:
    # ids must never repeat within a deployment: a worker ignores tensors of released ids
    return ChatSpec(
        request_id=f"{tag}-{uuid.uuid4().hex[:12]}",
        messages=[{"role": "user", "content": question}],
        sampling=SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
    )


async def _collect(d: Deployment, spec: ChatSpec) -> Outcome:
    out = Outcome()
    events = d.backend.chat(spec)
    try:
        async for event in events:
            out.add(event)
    finally:
        await events.aclose()
    return out


def _wait_drained(d: Deployment, timeout: float = 10.0) -> None:
    """Pages are released on the conductor's next plan after a request ends: poll."""
    engine = _engine(d)
    poll_drained(d, engine, timeout=timeout)
    conductor = d.runtime.conductor
    assert engine.pool.num_used_pages == 0, f"KV pages still held by {engine.pool.seq_ids()}"
    assert engine.seqs == {}
    assert conductor.idle, f"waiting={len(conductor.waiting)} live={list(conductor.live)}"
    assert all(units == 0 for units in conductor.in_use.values()), conductor.in_use
    assert d.runtime.tracked == {}
    assert len(d.runtime.workers.workers[0].store) == 0
    engine.pool.check_invariants()


def test_concurrent_greedy_matches_sequential(deployment: Deployment, recorder: Recorder) -> None:
    d = deployment
    assert d.runtime.healthy

    alone = [asyncio.run(_collect(d, _spec(q, f"alone{i}"))) for i, q in enumerate(QUESTIONS)]
    for question, out in zip(QUESTIONS, alone):
        assert out.finish_reason in ("stop", "length"), (question, out)
        assert out.text.strip() and out.token_ids, (question, out)
        assert 0 < out.completion_tokens <= MAX_TOKENS
    assert "Paris" in alone[0].text
    assert len({out.text for out in alone}) > 8, "the prompts should give different answers"
    _wait_drained(d)

    mark = len(recorder.batches)
    first_half = len(QUESTIONS) // 2

    async def together() -> list[Outcome]:
        first_token = asyncio.Event()

        async def early(i: int) -> Outcome:
            out = Outcome()
            events = d.backend.chat(_spec(QUESTIONS[i], f"batch{i}"))
            try:
                async for event in events:
                    out.add(event)
                    first_token.set()
            finally:
                await events.aclose()
            return out

        async def late(i: int) -> Outcome:
            # arrive while the first half is decoding, so that prefills join decode batches
            await first_token.wait()
            return await _collect(d, _spec(QUESTIONS[i], f"batch{i}"))

        jobs = [early(i) for i in range(first_half)] + [late(i) for i in range(first_half, len(QUESTIONS))]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

    batched = asyncio.run(together())
    for question, one, many in zip(QUESTIONS, alone, batched):
        assert many.token_ids == one.token_ids, question
        assert many.text == one.text, question
        assert many.finish_reason == one.finish_reason, question
        assert many.completion_tokens == one.completion_tokens, question

    batches = recorder.since(mark)
    sizes = [len(b) for b in batches]
    assert max(sizes) > 1, f"no batching happened: {sizes}"
    mixed = [b for b in batches if {"prefill", "decode"} <= {op for _, op in b}]
    assert mixed, f"no batch mixed a prefill with decodes: {[[op for _, op in b] for b in batches]}"
    assert any(sum(op == "decode" for _, op in b) > 1 for b in mixed)
    # every request was prefilled exactly once
    prefills = [rid for b in batches for rid, op in b if op == "prefill"]
    assert len(prefills) == len(set(prefills)) == len(QUESTIONS)

    _wait_drained(d)


def test_cancelled_streams_free_their_pages(deployment: Deployment, recorder: Recorder) -> None:
    d = deployment
    _wait_drained(d)
    mark = len(recorder.batches)
    n = 8
    # the ones that get cancelled would run for a long time otherwise
    specs = [_spec(QUESTIONS[i], f"cancel{i}", max_tokens=400, ignore_eos=True) if i % 2 == 0
             else _spec(QUESTIONS[i], f"keep{i}") for i in range(n)]
    cancelled_ids = {s.request_id for i, s in enumerate(specs) if i % 2 == 0}

    async def run_one(spec: ChatSpec) -> Outcome:
        out = Outcome()
        events = d.backend.chat(spec)
        try:
            async for event in events:
                out.add(event)
                if spec.request_id in cancelled_ids:
                    break  # after the first event
        finally:
            await events.aclose()
        return out

    async def all_of_them() -> list[Outcome]:
        return await asyncio.wait_for(asyncio.gather(*(run_one(s) for s in specs)), timeout=300)

    started = time.monotonic()
    outcomes = asyncio.run(all_of_them())
    for spec, out in zip(specs, outcomes):
        if spec.request_id in cancelled_ids:
            assert out.events == 1 and out.finish_reason is None
        else:
            assert out.finish_reason in ("stop", "length"), out
            assert out.text.strip() and 0 < out.completion_tokens <= MAX_TOKENS
    _wait_drained(d, timeout=30)
    elapsed = time.monotonic() - started

    # the cancelled requests stopped decoding soon after their clients left
    batches = recorder.since(mark)
    for request_id in cancelled_ids:
        steps = sum(rid == request_id for b in batches for rid, _ in b)
        assert 1 <= steps < 60, (request_id, steps, elapsed)

    # and the deployment still serves correctly afterwards
    after = asyncio.run(_collect(d, _spec(QUESTIONS[0], "after")))
    assert "Paris" in after.text and after.finish_reason == "stop"
    _wait_drained(d)


def test_abandoned_stream_after_its_event_loop_closed(deployment: Deployment) -> None:
    """A client leaves mid-stream and its event loop ends right away, while the runtime
    still has events (and the final close) for it: the runtime must drop them, not die."""
    d = deployment
    _wait_drained(d)

    async def leave_after_first_event() -> None:
        events = d.backend.chat(_spec(QUESTIONS[1], "abandon", max_tokens=200, ignore_eos=True))
        async for _ in events:
            break
        await events.aclose()

    asyncio.run(leave_after_first_event())  # closes the loop the request's sink targets
    _wait_drained(d)
    assert all(thread.is_alive() for thread in d.runtime._threads)
    assert d.runtime.healthy
    after = asyncio.run(asyncio.wait_for(_collect(d, _spec(QUESTIONS[0], "after-abandon")), 120))
    assert "Paris" in after.text and after.finish_reason == "stop"
    _wait_drained(d)
