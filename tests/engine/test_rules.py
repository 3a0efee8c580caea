"""A model's own token rules, handed to the engine (no subclass): a logit mask, per-sequence
state, an output beside ``token`` and rows held back from running ahead, the same with and
without overlap scheduling. A tiny random Llama on the CPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.rules import TokenRules
from mstar.model.llama import LlamaConfig, LlamaForCausalLM

VOCAB = 64


@dataclass
class Halves:
    seen: list[int] = field(default_factory=list)


class EvenTokens(TokenRules):
    """Only even ids; each step also writes ``half`` (token // 2); a row's fourth token is
    never chosen ahead (as if the host had to decide it, like a forced token)."""

    extra_outputs = True

    def start(self, params: dict) -> Halves:
        return Halves()

    def choose(self, logits, seqs, sample, lead=0):
        odd = torch.arange(logits.shape[-1], device=logits.device) % 2 == 1
        return sample(logits.masked_fill(odd, float("-inf")), seqs)

    def may_run_ahead(self, seq) -> bool:
        return seq.generated + 2 != 4  # the host knows `generated`; one token is in flight

    def outputs(self, seq, token: int) -> dict[str, torch.Tensor]:
        seq.state.seen.append(token // 2)
        return {"half": torch.tensor([token // 2])}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def generate(engine: AutoregressiveEngine, steps: int) -> tuple[dict[str, list[int]], list[bool]]:
    """Two greedy requests, ``steps`` tokens each: every step's outputs, and whether a step
    was launched ahead after each plan."""
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": steps, "stop_token_ids": []}
    prompts = {"a": [3, 5, 7], "b": [11, 2]}
    outs = engine.run([EngineItem(r, "prefill", 0, {"prompt_ids": torch.tensor(p)}, params)
                       for r, p in prompts.items()])
    written = {r: [(int(o.outputs["token"]), int(o.outputs["half"]))] for r, o in zip(prompts, outs)}
    ahead = [engine._ahead is not None]
    for step in range(1, steps):
        items = [EngineItem(r, "decode", step, {"token": o.outputs["token"]}, {}) for r, o in zip(prompts, outs)]
        outs = engine.run(items)
        for r, o in zip(prompts, outs):
            written[r].append((int(o.outputs["token"]), int(o.outputs["half"])))
        ahead.append(engine._ahead is not None)
    for r in prompts:
        assert engine.seqs[r].state.seen == [half for _, half in written[r]]
        engine.release(r)
    return written, ahead


def test_rules_choose_write_and_hold_rows_back(model) -> None:
    kwargs = dict(num_pages=16, page_size=4, max_seq_len=32, device=torch.device("cpu"), dtype=torch.float32,
                  rules=EvenTokens())
    eager = AutoregressiveEngine(model, KVLayout(2, 2, 8), **kwargs)
    overlap = AutoregressiveEngine(model, KVLayout(2, 2, 8), overlap_scheduling=True, **kwargs)
    want, _ = generate(eager, 6)
    got, ahead = generate(overlap, 6)
    assert got == want
    assert all(token % 2 == 0 and half == token // 2 for steps in want.values() for token, half in steps)
    # the plans of tokens 1, 2, 4 and 5 launch the next ahead; that of token 3 does not (the
    # 4th is held back), nor that of token 6 (the budget)
    assert ahead == [True, True, False, True, True, False]
