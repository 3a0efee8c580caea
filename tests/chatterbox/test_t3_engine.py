"""The T3 engine against the eager loop: requests batched with staggered starts (prefills
beside decodes, guided pairs beside an unguided row) draw exactly the tokens each draws alone
through ``t3_decode.generate`` (pinned to the reference in ``test_t3_parity.py``), greedy and
seeded; every page comes back."""

from __future__ import annotations

import msgspec
import pytest
import torch

from mstar.contract import SamplingParams
from mstar.engine.base import EngineItem
from mstar.engine.page_pool import OutOfPages
from mstar.model.chatterbox.conditioning import T3Conditioning
from mstar.model.chatterbox.t3_checkpoint import load_t3
from mstar.model.chatterbox.t3_decode import PagedSequences, T3Request, generate
from mstar.model.chatterbox.t3_engine import T3Engine
from tests.chatterbox.tiny import tiny_config

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.2)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.2, top_k=20)


def _requests(config, sampling: SamplingParams) -> list[tuple[T3Request, int]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for i, (length, cfg, emotion) in enumerate([(5, 0.5, 0.5), (9, 0.3, 1.2), (3, 0.0, 0.7)]):
        cond = T3Conditioning(torch.randn(1, config.speaker_embed_size, generator=gen),
                              torch.randint(0, config.start_speech_token, (1, 6), generator=gen), emotion)
        body = torch.randint(1, 30, (length,), generator=gen).tolist()
        text = [config.start_text_token, *body, config.stop_text_token] if config.guided else body
        out.append((T3Request(cond, torch.tensor(text), sampling, cfg, max_new_tokens=6 + i), 100 + i))
    return out


def _prefill_item(request_id: str, request: T3Request, seed: int) -> EngineItem:
    inputs = {"speaker_emb": request.cond.speaker_emb, "prompt_tokens": request.cond.prompt_tokens,
              "text_ids": request.text_ids}
    params = {"sampling": msgspec.structs.asdict(request.sampling), "cfg_weight": request.cfg_weight,
              "exaggeration": request.cond.emotion, "max_new_tokens": request.max_new_tokens, "seed": seed}
    return EngineItem(request_id, "prefill", 0, inputs, params)


@pytest.mark.parametrize("variant", ["english", "multilingual", "turbo"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_batched_tokens_equal_the_solo_loop(variant, sampling):
    config = tiny_config(variant)
    model = load_t3(None, config, dummy=True, seed=5)
    for p in model.parameters():  # dummy weights are small: scale them so the choices are not all alike
        p.data.mul_(20.0 if p.dim() >= 2 else 1.0)
    requests = _requests(config, sampling)
    solo = [generate(model, request, PagedSequences(model, 32, 4), torch.Generator().manual_seed(seed)).tokens
            for request, seed in requests]
    assert len({tuple(t) for t in solo}) == len(solo)

    engine = T3Engine(model, num_pages=64, page_size=4)
    tokens: dict[str, list[int]] = {}
    live: list[str] = []
    step = 0
    while step < len(requests) or live:
        items = [EngineItem(rid, "decode", len(tokens[rid]), {}, {}) for rid in live]
        if step < len(requests):  # one more request joins each step
            rid = f"r{step}"
            items.append(_prefill_item(rid, *requests[step]))
            tokens[rid] = []
            live.append(rid)
        for item, out in zip(items, engine.run(items)):
            tokens[item.request_id].append(int(out.outputs["token"]))
            if "stop" in out.flags:
                live.remove(item.request_id)
                engine.release(item.request_id)
        step += 1
    assert [tokens[f"r{i}"] for i in range(len(requests))] == solo
    assert engine.cache.pool.num_used_pages == 0


def test_a_failed_prefill_frees_what_it_took():
    model = load_t3(None, tiny_config("english"), dummy=True)
    engine = T3Engine(model, num_pages=2, page_size=4)  # too few pages for a guided prompt
    request, seed = _requests(model.config, GREEDY)[0]
    with pytest.raises(OutOfPages):
        engine.run([_prefill_item("r0", request, seed)])
    assert engine.requests == {} and engine.cache.pool.num_used_pages == 0


def test_a_failed_step_leaves_running_requests_where_they_were():
    """A decode whose step fails (here: a prefill beside it runs the pool dry) keeps its KV
    length, so retried alone it continues as if the failed step never ran."""
    model = load_t3(None, tiny_config("english"), dummy=True, seed=5)
    request, seed = _requests(model.config, GREEDY)[0]
    solo = generate(model, request, PagedSequences(model, 32, 4)).tokens
    engine = T3Engine(model, num_pages=12, page_size=4)
    first = engine.run([_prefill_item("r0", request, seed)])[0]
    tokens = [int(first.outputs["token"])]
    lengths = {row: engine.cache.pool.seq_len(row) for row in ("r0/cond", "r0/uncond")}
    big, _ = _requests(model.config, GREEDY)[1]
    with pytest.raises(OutOfPages):
        engine.run([EngineItem("r0", "decode", 1, {}, {}), _prefill_item("r1", big, 0)])
    assert set(engine.requests) == {"r0"}
    assert {row: engine.cache.pool.seq_len(row) for row in lengths} == lengths
    while len(tokens) < len(solo):
        tokens.append(int(engine.run([EngineItem("r0", "decode", len(tokens), {}, {})])[0].outputs["token"]))
    assert tokens == solo
