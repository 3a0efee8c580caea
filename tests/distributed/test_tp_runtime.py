"""A node group split over two worker processes (TP=2, gloo on the CPU) through the runtime.

A tiny random Llama in the Hugging Face layout, ``node_groups: [{node_names: [llm], ranks:
[0, 1], tp_size: 2}]``, started with ``ProcessWorkers``: rank 0 leads (plans come to it) and
rank 1 follows it in lockstep. Three concurrent greedy requests give the same tokens as the
TP=1 deployment of the same checkpoint, and the KV pages come back; a dead follower fails
and restarts the whole group, which then serves the same tokens. The engines' sampling
broadcast keeps unseeded draws of the TP ranks together. The configs the runtime cannot
run are startup errors naming the key. The runtime checks run on two GPUs too (``cuda``,
NCCL; skipped without them), in float32 without TF32.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from benchmarks.common import tiny_llama_dir
from mstar.config import ConfigError, parse_config
from mstar.distributed import use_parallel
from mstar.engine.base import EngineItem
from mstar.model.llama.model import LLM, LlamaChat
from mstar.model.spec import WalkRequest
from mstar.runtime.launch import Deployment, start
from tests.distributed.helpers import devices, fp32_only, mesh, rank_device, run_ranks

PAGE_SIZE = 4
PROMPTS = [[5, 9, 300, 17], [400, 3, 3, 80, 81, 82, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_TOKENS = [8, 6, 7]
TP2 = [{"node_names": ["llm"], "ranks": [0, 1], "tp_size": 2}]
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}")


def write_tiny_llama(path: Path) -> Path:
    """Config and tokenizer from the benchmark helper (with a chat template), random weights
    saved by transformers (large, so that greedy choices are clear and sharded sums cannot
    flip them)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlamaForCausalLM
    from transformers import PreTrainedTokenizerFast

    tiny_llama_dir(path, num_hidden_layers=2)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = HFLlamaConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = HFLlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tp_runtime"))


def _config(model_dir: Path, node_groups: list[dict], device: str = "cpu", **extra) -> dict:
    return {"model": "llama", "model_path": str(model_dir), "device": device, "dtype": "float32",
            "max_seq_len": 64, "max_concurrent_requests": 4, "node_groups": node_groups,
            "resources": {"kv_cache": {"max_num_pages": 32, "page_size": PAGE_SIZE}}, **extra}


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event) -> None:
        if event is None:
            self.done.set()
            return
        self.token_ids += event.token_ids
        self.error = event.error or self.error


def _generate(d: Deployment, tag: str) -> list[list[int]]:
    """Every prompt at once (greedy, EOS ignored); the tokens of each."""
    outs = []
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        params = {"sampling": {"temperature": 0.0}, "max_new_tokens": max_tokens,
                  "max_decode_steps": max_tokens - 1, "stop_token_ids": []}
        pages = -(-(len(prompt) + max_tokens) // PAGE_SIZE)
        request = WalkRequest("chat", {"prompt_ids": torch.tensor(prompt)}, params, {"kv_pages": pages},
                              prompt_tokens=len(prompt))
        out = Outcome()
        d.runtime.submit(f"{tag}-{i}", request, d.spec.output_stream(request, []), out)
        outs.append(out)
    for out in outs:
        assert out.done.wait(120), "a request did not finish"
        assert out.error is None, out.error
    return [out.token_ids for out in outs]


def _wait_for(condition, message: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def _leader_gauges_settle(d: Deployment) -> dict[str, float]:
    """Rank 0's gauges once the conductor is idle (the releases have run)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        gauges = d.runtime.rank_gauges.get(0, {})
        if d.runtime.conductor.idle and gauges.get("llm.kv_pages_used") == 0:
            break
        time.sleep(0.05)
    return d.runtime.rank_gauges[0]


@pytest.mark.parametrize("device", devices(2))
def test_tp2_process_workers_match_tp1(model_dir, device):
    with fp32_only(device):  # the TP=1 deployment runs in this process, the TP=2 one in workers
        _tp2_matches_tp1(model_dir, device)


def _tp2_matches_tp1(model_dir: Path, device: str) -> None:
    reference = start(parse_config(_config(model_dir, [], device)), in_process=True)
    try:
        expected = _generate(reference, "tp1")
    finally:
        reference.close()
    assert [len(t) for t in expected] == MAX_TOKENS
    assert len({tuple(t) for t in expected}) == len(PROMPTS)  # the prompts lead somewhere different

    split = start(parse_config(_config(model_dir, TP2, device)))
    try:
        assert split.runtime.conductor.ranks == [0]  # plans go to the leader only
        assert set(split.runtime.rank_gauges) == {0}  # the follower reports nothing
        assert split.runtime.rank_gauges[0]["llm.kv_pages_total"] == 32
        assert _generate(split, "tp2-a") == expected
        gauges = _leader_gauges_settle(split)
        assert gauges["llm.kv_pages_used"] == 0 and gauges["llm.sequences"] == 0
        # the follower released in lockstep too: a second round runs on clean state
        assert _generate(split, "tp2-b") == expected
        assert split.runtime.healthy

        # A dead follower takes its group down: the leader is reported failed (the runtime
        # never sees the follower), both are restarted at a new rendezvous, and serve again.
        pool = split.runtime.workers
        old = {rank: p.proc.pid for rank, p in pool.ranks.items()}
        os.kill(old[1], signal.SIGKILL)
        _wait_for(lambda: not split.runtime.healthy, "the runtime did not notice the dead follower")
        assert split.runtime.failure.startswith("worker rank 0 failed")  # its own error or the follower's
        _wait_for(lambda: split.runtime.healthy, "the group did not come back", timeout=120)
        assert all(p.proc.pid != old[rank] and p.proc.is_alive() for rank, p in pool.ranks.items())
        assert _generate(split, "tp2-c") == expected
    finally:
        split.close()
    for process in split.runtime.workers.ranks.values():
        assert not process.proc.is_alive()


def _unseeded_tokens(rank: int, world: int, folder: str, device_kind: str = "cpu") -> list[list[int]]:
    """Tokens the node's engine samples (temperature 1, no seed) on this TP rank, after
    seeding torch differently on every rank (and on every GPU)."""
    config = parse_config(_config(Path(folder), []))
    with use_parallel(mesh(world)):
        engine = LlamaChat(config).build_engines({LLM}, rank_device(device_kind, rank))[LLM]
    torch.manual_seed(1000 + rank)  # the CPU's and every GPU's generator
    sampling = {"temperature": 1.0, "top_k": 0}
    items = [EngineItem(f"r{i}", "prefill", 0, {"prompt_ids": torch.tensor(p)},
                        {"sampling": sampling, "max_new_tokens": 6}) for i, p in enumerate(PROMPTS)]
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(6):
        for row, out in enumerate(engine.run(items)):
            tokens[row].append(int(out.outputs["token"]))
        items = [EngineItem(f"r{i}", "decode", step, {"token": torch.tensor([t[-1]])}, {})
                 for i, t in enumerate(tokens)]
    return tokens


@pytest.mark.parametrize("device", devices(2))
def test_tp_ranks_sample_the_same_unseeded_tokens(model_dir, device):
    first, second = run_ranks(_unseeded_tokens, 2, str(model_dir), device, device=device)
    assert first == second
    assert len({tuple(t) for t in first}) > 1  # the draws are not degenerate


def test_in_process_refuses_a_split_group_naming_the_key(model_dir):
    with pytest.raises(ConfigError, match=r"node_groups\[0\].tp_size: a group split over several ranks needs one "
                                          r"worker process per rank"):
        start(parse_config(_config(model_dir, TP2)), in_process=True)


def test_tp_size_that_does_not_divide_the_heads_is_a_startup_error(model_dir):
    groups = [{"node_names": ["llm"], "ranks": [0, 1, 2], "tp_size": 3}]
    with pytest.raises(ConfigError, match=r"node_groups\[0\].tp_size: node 'llm': tp_size 3 does not divide "
                                          r"num_attention_heads \(4\)"):
        start(parse_config(_config(model_dir, groups)))
