"""The Wan DiT split over two ranks (gloo, 2 processes) equals the unsplit DiT.

The tiny checkpoint's ``transformer/`` (diffusers' key layout) loads at SP=2 and at TP=2
through the layers' weight loaders. The forward of two requests (one time per row, and TI2V's
time per token with the first frame at 0) equals SP=1 within 1e-5 on both ranks. The grid
has 45 tokens, so the two sequence shards differ in length; TP=2 splits every head-wide weight
and the q/k norms, which reduce their squares over both ranks (Wan normalises over all heads).
Through the runtime, with the DiT node over two worker processes (``sp_size: 2``, then
``tp_size: 2``), a guided text-to-video and an image-to-video request give the frames of the
one-rank deployment within one uint8 level; so do they with ``cfg_parallel`` and the
unconditional branch in the second worker process. The DiT's split limits are declared for startup
checks, and the two-GPU configs place it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.distributed import SINGLE, ParallelState, build_mesh, use_parallel
from mstar.model.wan22.config import WanTransformerConfig
from mstar.model.wan22.transformer import WanTransformer
from mstar.model.weights import iter_safetensors, load_weights
from tests.distributed.helpers import check_two_gpu_config, rel_error, run_ranks

TOL = 1e-5
BATCH, TEXT_LEN = 2, 5
LATENT = (4, 3, 6, 10)  # [C, F, H, W]: a 3 x 3 x 5 token grid (patch 1 x 2 x 2), 45 tokens
FIRST_FRAME = 15  # tokens of the first latent frame


def build_dit(root: Path, state: ParallelState) -> WanTransformer:
    config = WanTransformerConfig.from_dict(json.loads((root / "transformer" / "config.json").read_text()))
    with use_parallel(state):
        dit = WanTransformer(config)
    load_weights(dit, iter_safetensors(root / "transformer"))
    return dit.eval()


def forward_inputs(text_dim: int) -> dict[str, tuple]:
    """Two requests at different times: one time per row, and per token (TI2V's clean first frame)."""
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(BATCH, *LATENT, generator=generator)
    text = torch.randn(BATCH, TEXT_LEN, text_dim, generator=generator)
    rows = torch.tensor([300.0, 850.0])
    tokens = rows[:, None].repeat(1, 45)
    tokens[:, :FIRST_FRAME] = 0.0
    return {"per row": (latents, rows, text), "per token": (latents, tokens, text)}


def _split_runs(rank: int, world: int, root: Path) -> dict:
    layouts = {"sp=2": build_mesh(range(2), 1, 2), "tp=2": build_mesh(range(2), 2, 1)}
    result: dict = {"forward": {}, "shapes": {}}
    for name, state in layouts.items():
        dit = build_dit(root, state)
        text_dim = dit.config.text_dim
        with torch.no_grad():
            for times, inputs in forward_inputs(text_dim).items():
                result["forward"][name, times] = dit(*inputs)
        attn = dit.blocks[0].attn1
        result["shapes"][name] = (tuple(attn.to_q.weight.shape), tuple(attn.norm_q.weight.shape),
                                  tuple(dit.blocks[0].ffn.net[2].weight.shape))
    return result


def test_dit_at_sp2_and_tp2_equals_sp1(checkpoint):
    root = checkpoint.root
    single = build_dit(root, SINGLE)
    c = single.config
    expected = {}
    with torch.no_grad():
        for times, inputs in forward_inputs(c.text_dim).items():
            expected[times] = single(*inputs)
            assert rel_error(expected[times], checkpoint.transformer(*inputs, return_dict=False)[0]) <= TOL
    assert rel_error(expected["per row"], expected["per token"]) > 1e-3  # the per-token times matter

    dim = c.dim
    whole = ((dim, dim), (dim,), (dim, c.ffn_dim))
    halves = ((dim // 2, dim), (dim // 2,), (dim, c.ffn_dim // 2))
    for rank, result in enumerate(run_ranks(_split_runs, 2, root, timeout=60)):
        for (name, times), out in result["forward"].items():
            err = rel_error(out, expected[times])
            print(f"[wan22 rank {rank}] {name}, time {times}: max rel err {err:.2e}")
            assert err <= TOL, f"rank {rank} {name} {times}: {err:.3e}"
        for name, shapes in result["shapes"].items():  # TP really splits the weights
            assert shapes == (halves if name == "tp=2" else whole), (rank, name, shapes)


def test_wan22_declares_what_its_dit_splits(checkpoint):
    from mstar.config import parse_config
    from mstar.model.wan22.model import Wan22

    for cfg_parallel, nodes in ((False, {"dit"}), (True, {"dit", "dit_uncond"})):
        spec = Wan22(parse_config({"model": "wan22", "model_path": str(checkpoint.root),
                                   "model_kwargs": {"cfg_parallel": cfg_parallel}}))
        dims = spec.parallel_dims()
        assert set(dims) == nodes  # the text encoder and the VAE run whole
    heads, ffn = spec.checkpoint().transformer_config().num_attention_heads, 40
    assert dims["dit"].tensor == {"num_attention_heads": heads, "ffn_dim": ffn}
    assert dims["dit"].problems(2, 1) == [] and dims["dit"].problems(1, 2) == []
    assert dims["dit"].problems(1, 4) == [f"tp_size x sp_size (4) does not divide num_attention_heads ({heads})"]


@pytest.mark.parametrize("name, split", [("wan22_sp2.yaml", (1, 2)), ("wan22_tp2.yaml", (2, 1))])
def test_two_gpu_configs_split_the_dit(checkpoint, name, split):
    check_two_gpu_config(name, str(checkpoint.root), split, ("t2v_guided", "i2v_guided"))


def videos(root: Path, node_groups: list, in_process: bool, **knobs) -> list[np.ndarray]:
    """A guided text-to-video and an image-to-video request (per-token times) through a
    deployment of the tiny checkpoint; their uint8 frames."""
    from test_wan22_walk import generate, make_image, png

    from mstar.config import parse_config
    from mstar.runtime.launch import start

    config = {"model": "wan22", "model_path": str(root), "dtype": "float32", "max_concurrent_requests": 2,
              "node_groups": node_groups,
              "model_kwargs": {"num_inference_steps": 3, "max_video_pixels": 64 * 64 * 9, **knobs}}
    d = start(parse_config(config), in_process=in_process)
    try:
        return [generate(d, "t2v", "a cat walks on the moon", seed=7, guidance_scale=4.0),
                generate(d, "i2v", "a dog on the sunlit floor", [("image.png", png(make_image()))], seed=8)]
    finally:
        d.close()


@pytest.fixture(scope="module")
def one_rank_videos(checkpoint) -> list[np.ndarray]:
    return videos(checkpoint.root, [], in_process=True)


@pytest.mark.parametrize("split", [{"sp_size": 2}, {"tp_size": 2}], ids=["sp=2", "tp=2"])
def test_videos_with_the_dit_over_two_worker_processes_equal_one_rank(checkpoint, one_rank_videos, split):
    """Whole guided requests (UMT5, UniPC steps with the CFG pair, VAE encode and decode) with
    the DiT split over two worker processes give the single-rank frames."""
    groups = [{"node_names": ["text_encoder", "vae"], "ranks": [0]},
              {"node_names": ["dit"], "ranks": [0, 1], **split}]
    for ours, single in zip(videos(checkpoint.root, groups, in_process=False), one_rank_videos):
        assert single.std() > 1  # not a flat clip
        assert np.abs(ours - single).max() <= 1  # within one uint8 level


def test_cfg_parallel_over_two_worker_processes_equals_the_batched_pair(checkpoint, one_rank_videos):
    """``cfg_parallel`` with the unconditional branch (``dit_uncond``) in a second worker
    process gives the frames of the batched pair in one forward."""
    groups = [{"node_names": ["text_encoder", "dit", "vae"], "ranks": [0]},
              {"node_names": ["dit_uncond"], "ranks": [1]}]
    for ours, pair in zip(videos(checkpoint.root, groups, in_process=False, cfg_parallel=True), one_rank_videos):
        assert np.abs(ours - pair).max() <= 1
