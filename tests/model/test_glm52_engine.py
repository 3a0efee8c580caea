"""GLM-5.2 on the shared autoregressive engine, whose cache is one latent row per token
(``KVLayout(planes=1)``): greedy tokens equal the reference's greedy loop; a prompt found in
the prefix cache continues as it does computed; a request's latent rows exported from one
engine and imported into another continue the same."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.model.glm52 import Glm52Config, Glm52ForCausalLM
from mstar.model.weights import load_weights
from tests.support.glm52 import released_tensors, tiny_reference

STEPS = 6
PROMPT = torch.randint(2, 96, (19,), generator=torch.Generator().manual_seed(2)).tolist()
GREEDY = {"sampling": {"temperature": 0.0}, "max_new_tokens": 64, "stop_token_ids": []}


@pytest.fixture(scope="module")
def pair():
    ref = tiny_reference(seed=13)
    ours = Glm52ForCausalLM(Glm52Config.from_dict(ref.config.to_dict())).eval()
    load_weights(ours, released_tensors(ref).items())
    return ref, ours


def engine(model: Glm52ForCausalLM, prefix_caching: bool) -> AutoregressiveEngine:
    return AutoregressiveEngine(model, KVLayout(*model.cache_shape()), num_pages=24, page_size=4, max_seq_len=64,
                                device=torch.device("cpu"), dtype=torch.float32, prefix_caching=prefix_caching)


def generate(eng: AutoregressiveEngine, rid: str, prompt: list[int], steps: int) -> list[int]:
    token = int(eng.run([EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(prompt)}, GREEDY)])[0]
                .outputs["token"])
    tokens = [token]
    for _ in range(steps - 1):
        out = eng.run([EngineItem(rid, "decode", 0, {"token": torch.tensor([tokens[-1]])}, {})])
        tokens.append(int(out[0].outputs["token"]))
    return tokens


@torch.no_grad()
def reference_greedy(ref, prompt: list[int], steps: int) -> list[int]:
    cache = DynamicCache(config=ref.config)
    logits = ref(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    tokens = [int(logits.argmax())]
    for _ in range(steps - 1):
        logits = ref(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens


def test_engine_greedy_equals_reference(pair) -> None:
    ref, ours = pair
    eng = engine(ours, prefix_caching=False)
    assert eng.kv_caches[0].shape == (1, 24, 4, 1, ours.config.cache_width)
    assert generate(eng, "r", PROMPT, STEPS) == reference_greedy(ref, PROMPT, STEPS)
    eng.release("r")
    assert eng.pool.num_used_pages == 0


def test_prefix_cache_hit_continues_as_computed(pair) -> None:
    _, ours = pair
    cached, plain = engine(ours, prefix_caching=True), engine(ours, prefix_caching=False)
    generate(cached, "first", PROMPT, 2)
    cached.release("first")
    longer = PROMPT + [7, 9, 11]
    assert generate(cached, "second", longer, STEPS) == generate(plain, "second", longer, STEPS)
    assert cached.prefix_hits >= 16  # the first 16 tokens' pages came from the cache


def test_latent_rows_hand_off_between_engines(pair) -> None:
    _, ours = pair
    first, second = engine(ours, prefix_caching=False), engine(ours, prefix_caching=False)
    generate(second, "pad", [3] * 9, 1)  # the adopted request lands in other pages
    whole = generate(first, "r", PROMPT, STEPS)
    first.release("r")
    token = generate(first, "h", PROMPT, 1)[0]
    kv = first.export_kv("h")
    assert kv.shape == (len(ours.model.layers), 1, len(PROMPT), 1, ours.config.cache_width)
    second.import_kv("h", kv, PROMPT + [token], prompt_len=len(PROMPT), params=GREEDY)
    tokens = [token]
    for _ in range(STEPS - 1):
        out = second.run([EngineItem("h", "decode", 0, {"token": torch.tensor([tokens[-1]])}, {})])
        tokens.append(int(out[0].outputs["token"]))
    assert tokens == whole
    width = ours.config.cache_width  # 32 + 8 + 16
    with pytest.raises(ValueError, match=rf"\[3, 1, tokens, 1, {width}\]"):  # K/V planes do not fit a latent cache
        second.import_kv("x", torch.zeros(3, 2, 4, 1, width), PROMPT, prompt_len=len(PROMPT), params=GREEDY)
