"""Command A+ at TP=2 and TP=4 over gloo equals TP=1 (fp32, CPU, a tiny random checkpoint in
the released layout, experts stored one by one): logits at a batched prefill of three
requests, one past the sliding window, and at every decode step after; each rank holds its
share of the heads and of every expert's features (the shared expert's too), the router
whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.distributed import SINGLE, use_parallel
from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.command_a_plus.checkpoint import CommandAPlusCheckpoint
from tests.distributed.helpers import mesh, rel_error, run_ranks
from tests.support.pages import Pages

TOL = 1e-5
PROMPTS = [("a", 5), ("long", 13), ("c", 3)]
DECODE_STEPS = 6


def write_checkpoint(path: Path) -> Path:
    # Imported here: the spawned ranks import this module and need no transformers.
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    config = Cohere2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, num_experts=8, num_experts_per_tok=3, num_shared_experts=1,
        sliding_window=8, max_position_embeddings=256, logit_scale=0.25, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = Cohere2MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@torch.no_grad()
def work(rank: int, world: int, folder: str) -> dict:
    state = mesh(world) if world > 1 else SINGLE
    with use_parallel(state):
        model = CommandAPlusCheckpoint(Path(folder)).load_model(torch.device("cpu"), torch.float32, dummy=False,
                                                                seed=0)
    layer = model.model.layers[0]
    out: dict = {"shards": (tuple(layer.mlp.experts.gate_up.weight.shape), tuple(layer.self_attn.qkv_proj.weight.shape),
                            tuple(layer.mlp.shared_experts.down_proj.weight.shape)), "cache": model.cache_shape()}
    layers, heads, head_dim = model.cache_shape()
    caches, pages = allocate_kv_cache(layers, 32, 4, heads, head_dim, torch.float32, "cpu"), Pages(32, 4, seed=2)
    gen = torch.Generator().manual_seed(6)
    ids = torch.cat([torch.randint(0, 128, (n,), generator=gen) for _, n in PROMPTS])
    steps = [model.compute_logits(model(ids, pages.step(PROMPTS), caches))]
    for _ in range(DECODE_STEPS):
        ids = torch.randint(0, 128, (len(PROMPTS),), generator=gen)
        steps.append(model.compute_logits(model(ids, pages.step([(s, 1) for s, _ in PROMPTS]), caches)))
    out["logits"] = steps
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("command_a_plus_tp") / "ckpt"))


@pytest.mark.parametrize("world", [2, 4])
def test_logits_equal_tp1(folder: str, world: int) -> None:
    one = work(0, 1, folder)
    ranks = run_ranks(work, world, folder)
    for rank, result in enumerate(ranks):
        # each rank: its share of the experts' features (gate and up rows), of the heads, of the shared expert
        assert result["shards"] == ((8, 2 * 32 // world, 64), ((8 + 2 * 4) * 8 // world, 64), (64, 32 // world))
        assert result["cache"] == (4, 4 // world, 8)
        for step, (ours, ref) in enumerate(zip(result["logits"], one["logits"])):
            assert rel_error(ours, ref) <= TOL, (world, rank, step)
