"""The speech-token LM on the autoregressive engine with ``RasRules`` (tiny dummy weights, CPU):
two seeded requests batched in one engine, one joining a step late, sample exactly the tokens
each samples alone through ``synthesis.speech_tokens``, and stop where it stops."""

from __future__ import annotations

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.model.cosyvoice3.engine import RasRules, lm_params
from mstar.model.cosyvoice3.synthesis import speech_tokens


def test_batched_engine_samples_as_each_request_alone(parts) -> None:
    lm, _, _, prompt = parts
    texts = {"a": torch.arange(20, 25), "b": torch.arange(30, 33)}
    seeds = {"a": 3, "b": 4}
    solo = {r: list(speech_tokens(lm, t, prompt, torch.Generator().manual_seed(seeds[r]), silent=frozenset()))
            for r, t in texts.items()}
    layers, kv_heads, head_dim = lm.cache_shape()
    engine = AutoregressiveEngine(lm, KVLayout(layers, kv_heads, head_dim), num_pages=64, page_size=4,
                                  max_seq_len=128, device=torch.device("cpu"), dtype=torch.float32, rules=RasRules())
    got: dict[str, list[int]] = {r: [] for r in texts}
    last: dict[str, torch.Tensor] = {}
    live: list[str] = []
    for step in range(200):
        items = [EngineItem(r, "decode", step, {"token": last[r]}, {}) for r in live]
        if step < 2:  # "a" joins at step 0, "b" at step 1
            r = list(texts)[step]
            ids = lm.prompt_ids(torch.cat([prompt.text_ids, texts[r]]), prompt.speech)
            params = lm_params(lm.config, len(texts[r]), seeds[r])
            items.append(EngineItem(r, "prefill", 0, {"prompt_ids": ids}, params))
            live.append(r)
        if not items:
            break
        for item, out in zip(items, engine.run(items)):
            token = int(out.outputs["token"])
            if "stop" in out.flags:
                live.remove(item.request_id)
                engine.release(item.request_id)
                if token not in lm.config.stop_ids:  # stopped at max_new_tokens: the last token counts
                    got[item.request_id].append(token)
            else:
                got[item.request_id].append(token)
                last[item.request_id] = out.outputs["token"]
    assert not live
    assert got == solo
    assert all(len(t) >= 2 * len(texts[r]) for r, t in got.items())
