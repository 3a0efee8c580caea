"""KV pages outside a sliding window go back to the pool while a request runs: the pool's
``release_before`` bookkeeping, and the autoregressive engine on a tiny Command A+ (three
sliding-window layers of window 8 per global one) decoding a request five windows long with
the same greedy tokens as transformers and as the engine without the release."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.page_pool import PagePool
from mstar.engine.window_pages import SlidingWindowPages
from mstar.model.command_a_plus import CommandAPlusConfig, CommandAPlusForCausalLM
from mstar.model.weights import iter_safetensors, load_weights

PAGE_SIZE = 4
WINDOW = 8


def test_release_before_lets_go_of_whole_pages_only() -> None:
    pool = PagePool(8, 4)
    pool.reserve("a", 14)  # 4 pages
    table = pool.page_table("a")
    assert pool.release_before("a", 3) == 0  # page 0 still holds position 3
    assert pool.release_before("a", 9) == 2 and pool.num_used_pages == 2
    assert pool.page_table("a") == [0, 0, *table[2:]] and pool.released("a") == 2
    assert pool.release_before("a", 5) == 0  # already done
    assert pool.release_before("a", 100) == 1  # never the last page: the newest positions
    pool.check_invariants()
    with pytest.raises(IndexError, match="released"):
        pool.slot("a", 11)
    assert pool.slot("a", 13) == table[3] * 4 + 1
    with pytest.raises(ValueError, match="released"):
        pool.truncate("a", 8)
    pool.reserve("a", 17)
    pool.reserve("b", 20)  # the released pages are free again: 5 + the 2 "a" holds
    pool.check_invariants()
    assert pool.free("a") == 2 and pool.free("b") == 5 and pool.num_free_pages == 8
    pool.check_invariants()


def test_sliding_window_pages_release_on_reserve() -> None:
    pages = SlidingWindowPages(16, 4, window=8, window_pages=5)
    for length in range(1, 41):  # one decode step at a time
        assert pages.can_reserve("a", length)
        pages.reserve("a", length)
        pages.check_invariants()
        # the next step's first query (at length - 1) sees from length - 8 on: at most 4 pages
        assert pages.windowed.num_used_pages <= 4
    assert pages.full.num_used_pages == 10 and pages.windowed.released("a") >= 6
    assert not pages.can_reserve("b", 20)  # the windowed pool holds 5 pages
    pages.truncate("a", 39)
    assert pages.free("a") == 10 and pages.windowed.num_used_pages == 0
    pages.check_invariants()


def _pair(tmp_path: Path) -> tuple[Cohere2MoeForCausalLM, CommandAPlusForCausalLM]:
    config = Cohere2MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        sliding_window=WINDOW, max_position_embeddings=128, eos_token_id=2, bos_token_id=1, pad_token_id=0,
        attn_implementation="eager")
    torch.manual_seed(0)
    hf = Cohere2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = CommandAPlusForCausalLM(CommandAPlusConfig.from_hf_dict(config.to_dict())).eval()
    load_weights(ours, iter_safetensors(tmp_path))
    return hf, ours


def _decode_all(engine: AutoregressiveEngine, prompts: dict[str, list[int]], max_new: dict[str, int],
                watch: callable = lambda: None) -> dict[str, list[int]]:
    """Greedy decoding of every prompt, batched, one engine step at a time; ``watch`` runs
    after every step. The generated ids per request."""
    params = {rid: {"sampling": {"temperature": 0.0}, "max_new_tokens": n, "stop_token_ids": []}
              for rid, n in max_new.items()}
    items = [EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(p)}, params[rid]) for rid, p in prompts.items()]
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while items:
        results = engine.run(items)
        watch()
        nxt = []
        for item, result in zip(items, results):
            token = int(result.outputs["token"])
            out[item.request_id].append(token)
            if "stop" in result.flags:
                engine.release(item.request_id)
            else:
                nxt.append(EngineItem(item.request_id, "decode", 0, {"token": torch.tensor([token])}, {}))
        items = nxt
    return out


@torch.no_grad()
def test_engine_releases_window_pages_with_identical_tokens(tmp_path: Path) -> None:
    hf, ours = _pair(tmp_path)
    prompts = {"long": [5, 17, 33, 8, 61, 9], "short": [44, 3, 70]}
    max_new = {"long": 34, "short": 6}  # "long" ends at 40 positions: five windows
    layers, heads, dim = ours.cache_shape()

    def engine(windows: tuple[int | None, ...]) -> AutoregressiveEngine:
        return AutoregressiveEngine(ours, KVLayout(layers, heads, dim, windows=windows), num_pages=24,
                                    page_size=PAGE_SIZE, max_seq_len=64, device=torch.device("cpu"),
                                    dtype=torch.float32)

    windowed = engine(ours.kv_windows())
    pool = windowed.pool
    assert isinstance(pool, SlidingWindowPages)
    seen: list[tuple[int, int]] = []

    def watch() -> None:
        pool.check_invariants()
        if pool.has("long"):
            live = len(pool.windowed.page_table("long")) - pool.windowed.released("long")
            seen.append((len(pool.full.page_table("long")), live))

    released = _decode_all(windowed, prompts, max_new, watch)
    # the full pool grows with the request; the windowed pool holds its window and a page or two
    assert seen[-1][0] == 10 and max(live for _, live in seen) <= WINDOW // PAGE_SIZE + 2
    assert pool.windowed.num_used_pages == 0 and pool.full.num_used_pages == 0
    assert windowed.stats()["kv_window_pages_used"] == 0

    plain = _decode_all(engine(()), prompts, max_new)  # one pool, nothing released
    assert released == plain
    for rid, prompt in prompts.items():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new[rid], do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert released[rid] == ref, rid
