"""GLM-5.2 at TP=2 and TP=4 over gloo equals TP=1 (fp32, CPU, a tiny random config).

A released-layout directory (experts apart) is loaded by each rank under the parallel state,
as worker ranks do: the heads of ``q_b_proj``/``kv_b_proj``/``o_proj``, every expert's and the
shared expert's features and the vocabulary split, the latent compressions, the indexer and the
routers whole. Three requests run a batched prefill (the indexer dropping keys) and three
decode steps; the logits equal one process's within 1e-5 relative. A ``tp_size`` that does
not divide the heads is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mstar.distributed import SINGLE, use_parallel
from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.glm52.checkpoint import Glm52Checkpoint
from tests.distributed.helpers import mesh, rel_error, run_ranks
from tests.support.pages import Pages

TOL = 1e-5
PROMPTS = [("a", 5), ("b", 12), ("c", 17)]
DECODE_STEPS = 3


def write_checkpoint(path: Path) -> Path:
    from safetensors.torch import save_file

    from tests.support.glm52 import released_tensors, tiny_reference

    ref = tiny_reference(seed=11)
    save_file({n: t.contiguous() for n, t in released_tensors(ref).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(ref.config.to_dict()))
    return path


@torch.no_grad()
def work(rank: int, world: int, folder: str) -> list[torch.Tensor]:
    state = mesh(world) if world > 1 else SINGLE
    with use_parallel(state):
        model = Glm52Checkpoint.locate(folder).load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    layers, heads, width, planes = model.cache_shape()
    caches = allocate_kv_cache(layers, 32, 4, heads, width, torch.float32, "cpu", planes=planes)
    pages = Pages(num_pages=32, page_size=4)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (sum(n for _, n in PROMPTS),), generator=gen)
    out = [model.compute_logits(model(ids, pages.step(PROMPTS), caches))]
    for _ in range(DECODE_STEPS):
        ids = torch.randint(2, vocab, (len(PROMPTS),), generator=gen)
        out.append(model.compute_logits(model(ids, pages.step([(name, 1) for name, _ in PROMPTS]), caches)))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("glm52_tp")))


@pytest.mark.parametrize("world", [2, 4])
def test_logits_equal_tp1(folder: str, world: int) -> None:
    one = work(0, 1, folder)
    for rank, result in enumerate(run_ranks(work, world, folder)):
        for step, (ours, ref) in enumerate(zip(result, one)):
            assert rel_error(ours, ref) <= TOL, (world, rank, step)


def test_tp_size_must_divide_the_heads(folder: str) -> None:
    from mstar.config import parse_config
    from mstar.model.registry import model_class

    config = parse_config({"model": "glm52", "model_path": folder, "device": "cpu",
                           "node_groups": [{"node_names": ["llm"], "ranks": [0, 1, 2], "tp_size": 3}]})
    problems = model_class("glm52")(config).parallel_dims()["llm"].problems(3, 1)
    assert any("num_attention_heads (4)" in p for p in problems), problems
