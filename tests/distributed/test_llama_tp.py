"""The Llama decoder at TP=2 over gloo equals TP=1: the same checkpoint folder (Hugging Face
key layout) loads on both, and a batched prefill plus greedy decode steps through the paged
KV cache give the same logits (1e-5) and the same tokens. The model's engines, built by
``LlamaChat.build_engines`` under the parallel state (as a worker rank will), sample the
same tokens as at TP=1 with per-rank KV pools. The same checks run over NCCL on two GPUs
(``cuda``; skipped without them), each rank comparing on its own GPU in float32."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from mstar.config import parse_config
from mstar.distributed import use_parallel
from mstar.engine.base import EngineItem
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.llama.checkpoint import LlamaCheckpoint
from mstar.model.llama.model import LLM, LlamaChat
from mstar.model.llama.modeling import LlamaForCausalLM
from mstar.model.weights import load_weights
from tests.distributed.helpers import devices, mesh, rank_device, rel_error, run_ranks

TOL = 1e-5
PAGE_SIZE, NUM_PAGES = 4, 32
DECODE_STEPS = 4
PROMPTS = {"a": [5, 17, 99, 3, 42, 7, 8], "b": [120, 1, 64, 64, 2, 77, 31, 9, 10, 11, 12]}


def write_checkpoint(path: Path, tied: bool) -> Path:
    """A tiny random HF Llama (4 heads, 2 KV heads, odd vocabulary) saved by transformers."""
    # Imported here: the spawned ranks import this module, and need no transformers.
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlamaForCausalLM

    config = HFLlamaConfig(vocab_size=131, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = HFLlamaForCausalLM(config)
    with torch.no_grad():  # large weights: attention far from uniform, clear greedy choices
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


class PagedSteps:
    """Metadata of consecutive steps over shuffled pages (one page table per sequence)."""

    def __init__(self) -> None:
        self.free = list(range(NUM_PAGES))
        random.Random(1).shuffle(self.free)
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: dict[str, int], device: torch.device) -> PagedAttentionMetadata:
        positions, slots, starts, seq_lens = [], [], [0], []
        for seq, n in chunks.items():
            pages = self.pages.setdefault(seq, [])
            old = self.lens.get(seq, 0)
            self.lens[seq] = old + n
            while len(pages) * PAGE_SIZE < old + n:
                pages.append(self.free.pop())
            positions += range(old, old + n)
            slots += [pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(old, old + n)]
            starts.append(starts[-1] + n)
            seq_lens.append(old + n)
        width = max(len(self.pages[s]) for s in chunks)
        table = [self.pages[s] + [0] * (width - len(self.pages[s])) for s in chunks]
        return PagedAttentionMetadata(*(torch.tensor(v, device=device) for v in (positions, slots, starts, seq_lens,
                                                                                  table)), PAGE_SIZE)


@torch.no_grad()
def greedy(model: LlamaForCausalLM, device: torch.device) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Logits of every step (prefill of both prompts, then decodes; on the CPU) and the
    greedy tokens, the model and its KV cache on ``device``."""
    layers, kv_heads, head_dim = model.cache_shape()
    caches = allocate_kv_cache(layers, NUM_PAGES, PAGE_SIZE, kv_heads, head_dim, torch.float32, device)
    steps, tokens = PagedSteps(), {s: [] for s in PROMPTS}
    meta = steps.step({s: len(p) for s, p in PROMPTS.items()}, device)
    ids = torch.tensor([t for p in PROMPTS.values() for t in p], device=device)
    hidden = model(ids, meta, caches)
    all_logits = [model.compute_logits(hidden[meta.query_start_loc[1:] - 1])]
    for _ in range(DECODE_STEPS + 1):
        for seq, row in zip(PROMPTS, all_logits[-1].argmax(-1).tolist()):
            tokens[seq].append(row)
        if len(all_logits) == DECODE_STEPS + 1:
            break
        meta = steps.step({s: 1 for s in PROMPTS}, device)
        last = torch.tensor([tokens[s][-1] for s in PROMPTS], device=device)
        all_logits.append(model.compute_logits(model(last, meta, caches)))
    return [logits.cpu() for logits in all_logits], tokens


def engine_tokens(folder: str, device: torch.device) -> tuple[dict[str, list[int]], int]:
    """Tokens the node's engine produces for a greedy and a seeded sampled request, and the
    KV heads its cache holds."""
    config = parse_config({"model": "llama", "model_path": folder, "max_seq_len": 64,
                           "resources": {"kv_cache": {"max_num_pages": 16, "page_size": PAGE_SIZE}}})
    engine = LlamaChat(config).build_engines({LLM}, device)[LLM]
    sampling = {"a": {"temperature": 0.0}, "b": {"temperature": 0.8, "seed": 7}}
    items = [EngineItem(s, "prefill", 0, {"prompt_ids": torch.tensor(p)},
                        {"sampling": sampling[s], "max_new_tokens": DECODE_STEPS + 1}) for s, p in PROMPTS.items()]
    tokens: dict[str, list[int]] = {s: [] for s in PROMPTS}
    for step in range(DECODE_STEPS + 1):
        for item, out in zip(items, engine.run(items)):
            tokens[item.request_id].append(int(out.outputs["token"]))
        items = [EngineItem(s, "decode", step, {"token": torch.tensor([t[-1]])}, {}) for s, t in tokens.items()]
    return tokens, engine.kv_caches[0].shape[-2]  # [2, pages, page_size, kv_heads, head_dim]


def _compare(rank: int, world: int, folders: list[str], device_kind: str = "cpu") -> list[dict]:
    device = rank_device(device_kind, rank)
    results = []
    for folder in folders:
        ckpt = LlamaCheckpoint.locate(folder)
        config = ckpt.config()
        with torch.device(device):
            reference = LlamaForCausalLM(config).eval()  # TP=1: no parallel state
            with use_parallel(mesh(world)):
                sharded = LlamaForCausalLM(config).eval()
        load_weights(reference, ckpt.tensors())
        load_weights(sharded, ckpt.tensors())
        ref_logits, ref_tokens = greedy(reference, device)
        tp_logits, tp_tokens = greedy(sharded, device)
        results.append({
            "cache_shape": (reference.cache_shape(), sharded.cache_shape()),
            "errors": [rel_error(ours, ref) for ours, ref in zip(tp_logits, ref_logits)],
            "tokens": (ref_tokens, tp_tokens),
        })
    reference_engine = engine_tokens(folders[0], device)
    with use_parallel(mesh(world)):
        results[0]["engine"] = (reference_engine, engine_tokens(folders[0], device))
    return results


@pytest.mark.parametrize("device", devices(2))
@pytest.mark.parametrize("world", [2])
def test_llama_at_tp2_equals_tp1(tmp_path, world, device):
    folders = [str(write_checkpoint(tmp_path / kind, tied=kind == "tied")) for kind in ("tied", "untied")]
    per_rank = run_ranks(_compare, world, folders, device, device=device)
    for rank, results in enumerate(per_rank):
        for kind, result in zip(("tied", "untied"), results):
            full, mine = result["cache_shape"]
            assert full == (2, 2, 8) and mine == (2, 2 // world, 8)  # each rank caches its KV heads
            steps = ["prefill"] + [f"decode {i}" for i in range(DECODE_STEPS)]
            for step, err in zip(steps, result["errors"]):
                print(f"[llama tp={world} {device} rank {rank} {kind}] {step}: max rel err {err:.2e}")
                assert err <= TOL, f"rank {rank} {kind} {step}: {err:.3e}"
            ref_tokens, tp_tokens = result["tokens"]
            assert tp_tokens == ref_tokens
            assert all(len(t) == DECODE_STEPS + 1 for t in ref_tokens.values())
    assert per_rank[0][0]["tokens"] == per_rank[1][0]["tokens"]
    for results in per_rank:
        (reference_engine, full_heads), (tp_engine, rank_heads) = results[0]["engine"]
        assert (full_heads, rank_heads) == (2, 2 // world)
        assert tp_engine == reference_engine
        assert reference_engine["a"] == per_rank[0][0]["tokens"][0]["a"]  # greedy: the model's argmax
