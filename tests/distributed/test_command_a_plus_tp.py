"""Command A+ at TP=2 and TP=4 over gloo equals TP=1 (fp32, CPU, a tiny random checkpoint in
the released layout, experts stored one by one): logits at a batched prefill of three
requests, one past the sliding window, and at every decode step after; each rank holds its
share of the heads and of every expert's features (the shared expert's too), the router
whole. With an image (a vision-language checkpoint): TP=2 equals TP=1, and only rank 0 holds
and runs the image encoder (rank 1 receives the image's tokens)."""

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
    return save_random(Cohere2MoeForCausalLM, config, path)


def save_random(cls, config, path):
    """A transformers model of ``cls`` with seeded random weights (norms near 1), saved at ``path``."""
    torch.manual_seed(0)
    model = cls(config)
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


IMAGE_IDS = {"image": 100, "boi": 101, "eoi": 102, "line_break": 103}


def write_vl_checkpoint(path: Path) -> Path:
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    text = dict(model_type="cohere2_moe", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
                num_shared_experts=1, sliding_window=8, max_position_embeddings=256, logit_scale=0.25,
                eos_token_id=2, bos_token_id=1)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)
    config = Cohere2VisionConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_IDS["image"],
                                 alignment_intermediate_size=64)
    return save_random(Cohere2VisionForConditionalGeneration, config, path)


@torch.no_grad()
def image_work(rank: int, world: int, folder: str) -> dict:
    from mstar.model.command_a_plus.processor import image_token_ids

    state = mesh(world) if world > 1 else SINGLE
    with use_parallel(state):
        model = CommandAPlusCheckpoint(Path(folder)).load_model(torch.device("cpu"), torch.float32, dummy=False,
                                                                seed=0)
    calls = []
    if model.vision is not None:
        model.vision.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randn(3, 3, 32, 32, generator=gen)  # three tiles (a 2x1 grid and its thumbnail)
    image_prompt = [1, 5, 9, *image_token_ids(3, model.vision_config.tokens_per_tile, IMAGE_IDS), 17, 23]
    text_prompt = torch.randint(0, 99, (11,), generator=gen).tolist()
    chunks = [("image", len(image_prompt)), ("text", len(text_prompt))]
    layers, heads, head_dim = model.cache_shape()
    caches, pages = allocate_kv_cache(layers, 32, 4, heads, head_dim, torch.float32, "cpu"), Pages(32, 4, seed=1)
    embeds = torch.cat([model.embed_with_images(torch.tensor(image_prompt), pixels),
                        model.embed_input_ids(torch.tensor(text_prompt))])
    steps = [model.compute_logits(model(None, pages.step(chunks), caches, inputs_embeds=embeds))]
    for _ in range(DECODE_STEPS):
        ids = torch.randint(0, 99, (2,), generator=gen)
        steps.append(model.compute_logits(model(ids, pages.step([(s, 1) for s, _ in chunks]), caches)))
    return {"logits": steps, "tower_calls": calls, "holds_tower": model.vision is not None,
            "vision_params": sum(p.numel() for n, p in model.named_parameters() if n.startswith("vision."))}


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory) -> str:
    return str(write_vl_checkpoint(tmp_path_factory.mktemp("command_a_plus_vl_tp") / "ckpt"))


def test_image_prompt_tp2_equals_tp1_tower_on_rank0_only(vl_folder: str) -> None:
    one = image_work(0, 1, vl_folder)
    assert one["holds_tower"] and one["tower_calls"] == [3]
    ranks = run_ranks(image_work, 2, vl_folder)
    assert [r["holds_tower"] for r in ranks] == [True, False]
    assert [r["tower_calls"] for r in ranks] == [[3], []]
    assert ranks[0]["vision_params"] == one["vision_params"] > 0 and ranks[1]["vision_params"] == 0
    for rank, result in enumerate(ranks):
        for step, (ours, ref) in enumerate(zip(result["logits"], one["logits"])):
            assert rel_error(ours, ref) <= TOL, (rank, step)
