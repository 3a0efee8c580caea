"""The LTX-2.5 DiT split over two ranks (gloo, 2 processes) equals the unsplit DiT.

The tiny checkpoint's ``transformer/`` loads at SP=2 and at TP=2 through the layers' weight
loaders. The forward of two requests (one time per row; and per video token with keyframes and
a separate audio time) equals SP=1 within 1e-5 on both ranks. The grid has 45 video tokens, so
the two sequence shards differ in length; the audio stream (7 frames) stays whole on each SP
rank, and TP=2 splits every attention's heads (video, audio and both audio-video attentions),
both FFNs and the q/k norms. Through the runtime, with the ``dit`` node over two worker
processes (``sp_size: 2``, then ``tp_size: 2``), a request gives the frames of the one-rank
deployment within one uint8 level and its audio within 1e-4 (the walk's bar against diffusers). The DiT's split limits
are declared for startup checks, and the two-GPU configs place it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.distributed import SINGLE, ParallelState, build_mesh, use_parallel
from mstar.model.ltx2_5.checkpoint import LtxCheckpoint
from mstar.model.ltx2_5.transformer import LtxTransformer
from mstar.model.weights import iter_safetensors, load_weights
from tests.distributed.helpers import check_two_gpu_config, rel_error, run_ranks
from tests.model.ltx2_5.test_ltx2_5_walk import FRAMES, HEIGHT, WIDTH, collect

TOL = 1e-5
BATCH, TEXT_LEN = 2, 6
GRID, AUDIO_FRAMES = (3, 3, 5), 7  # 45 video tokens: shards of 23 and 22


def build_dit(root: Path, state: ParallelState) -> LtxTransformer:
    config = LtxCheckpoint.locate(str(root)).transformer_config()
    with use_parallel(state):
        dit = LtxTransformer(config)
    load_weights(dit, iter_safetensors(root / "transformer"))
    return dit.eval()


def forward_inputs(dit: LtxTransformer) -> dict[str, tuple[tuple, dict]]:
    """Two requests: one time per row; and per video token (keyframes at time 0) with its own
    audio time and the keyframe embedding on the first latent frame."""
    c = dit.config
    gen = torch.Generator().manual_seed(1)
    tokens = GRID[0] * GRID[1] * GRID[2]
    video = torch.randn(BATCH, tokens, c.in_channels, generator=gen)
    audio = torch.randn(BATCH, AUDIO_FRAMES, c.audio_in_channels, generator=gen)
    text = torch.randn(BATCH, TEXT_LEN, c.dim, generator=gen)
    audio_text = torch.randn(BATCH, TEXT_LEN, c.audio_dim, generator=gen)
    mask = torch.ones(BATCH, TEXT_LEN)
    mask[1, 4:] = 0
    rows = torch.tensor([1000.0, 421.5])
    per_token = rows[:, None].repeat(1, tokens)
    per_token[:, :GRID[1] * GRID[2]] = 0.0
    keyframes = (per_token == 0).to(video.dtype)[..., None]
    common = dict(grid=GRID, fps=24.0, text_mask=mask)
    return {"per row": ((video, audio, text, audio_text, rows), common),
            "per token": ((video, audio, text, audio_text, per_token),
                          dict(common, audio_t=rows, sigma=rows, cross_timestep=False, keyframes_mask=keyframes))}


def _split_runs(rank: int, world: int, root: Path) -> dict:
    layouts = {"sp=2": build_mesh(range(2), 1, 2), "tp=2": build_mesh(range(2), 2, 1)}
    result: dict = {"forward": {}, "shapes": {}}
    for name, state in layouts.items():
        dit = build_dit(root, state)
        with torch.no_grad():
            for times, (args, kwargs) in forward_inputs(dit).items():
                result["forward"][name, times] = dit(*args, **kwargs)
        block = dit.transformer_blocks[0]
        result["shapes"][name] = tuple(tuple(w.shape) for w in (
            block.attn1.to_q.weight, block.attn1.norm_q.weight, block.video_to_audio_attn.to_k.weight,
            block.audio_attn1.to_gate_logits.weight, block.ff.net[2].weight, block.audio_ff.net[2].weight))
    return result


def test_dit_at_sp2_and_tp2_equals_sp1(checkpoint):
    root = checkpoint.root
    single = build_dit(root, SINGLE)
    expected = {}
    with torch.no_grad():
        for times, (args, kwargs) in forward_inputs(single).items():
            expected[times] = single(*args, **kwargs)
    assert rel_error(expected["per row"][0], expected["per token"][0]) > 1e-3  # the per-token times matter

    c = single.config
    dim, adim = c.dim, c.audio_dim
    ainner = c.audio_num_attention_heads * c.audio_attention_head_dim
    whole = ((dim, dim), (dim,), (ainner, dim), (c.audio_num_attention_heads, adim), (dim, 4 * dim),
             (adim, 4 * adim))
    halves = ((dim // 2, dim), (dim // 2,), (ainner // 2, dim), (c.audio_num_attention_heads // 2, adim),
              (dim, 2 * dim), (adim, 2 * adim))
    for rank, result in enumerate(run_ranks(_split_runs, 2, root, timeout=60)):
        for (name, times), (video, audio) in result["forward"].items():
            want_video, want_audio = expected[times]
            errs = rel_error(video, want_video), rel_error(audio, want_audio)
            print(f"[ltx2_5 rank {rank}] {name}, time {times}: max rel err video {errs[0]:.2e} audio {errs[1]:.2e}")
            assert max(errs) <= TOL, f"rank {rank} {name} {times}: {errs}"
        for name, shapes in result["shapes"].items():  # TP really splits the weights
            assert shapes == (halves if name == "tp=2" else whole), (rank, name, shapes)


def test_ltx2_5_declares_what_its_dit_splits(checkpoint):
    from mstar.config import parse_config
    from mstar.model.ltx2_5.model import Ltx25

    spec = Ltx25(parse_config({"model": "ltx2_5", "model_path": str(checkpoint.root)}))
    dims = spec.parallel_dims()
    assert set(dims) == {"dit"}  # the text encoder and the decoders run whole
    c = spec.checkpoint().transformer_config()
    heads = c.num_attention_heads
    assert dims["dit"].tensor == {"num_attention_heads": heads, "audio_num_attention_heads":
                                  c.audio_num_attention_heads, "ffn_dim": 4 * c.dim, "audio_ffn_dim": 4 * c.audio_dim}
    assert dims["dit"].problems(2, 1) == [] and dims["dit"].problems(1, 2) == []
    assert dims["dit"].problems(1, 4) == [f"tp_size x sp_size (4) does not divide num_attention_heads ({heads})"]
    assert f"tp_size 4 does not divide audio_num_attention_heads ({c.audio_num_attention_heads})" in \
        dims["dit"].problems(4, 1)


def test_a_bad_split_is_refused_at_startup(checkpoint):
    from mstar.config import parse_config
    from mstar.model.ltx2_5.model import Ltx25
    from mstar.runtime.placement import build_placement

    config = parse_config({"model": "ltx2_5", "model_path": str(checkpoint.root), "node_groups": [
        {"node_names": ["text_encoder", "vae_decoder", "audio_decoder"], "ranks": [0]},
        {"node_names": ["dit"], "ranks": [0, 1, 2, 3], "sp_size": 4}]})
    spec = Ltx25(config)
    with pytest.raises(ValueError, match="num_attention_heads"):
        build_placement(spec.graph(), config, spec)


@pytest.mark.parametrize("name, split", [("ltx2_5_sp2.yaml", (1, 2)), ("ltx2_5_tp2.yaml", (2, 1))])
def test_two_gpu_configs_split_the_dit(checkpoint, name, split):
    check_two_gpu_config(name, str(checkpoint.root), split, ("t2av", "t2v"))


def clip(root: Path, node_groups: list, in_process: bool) -> tuple[np.ndarray, np.ndarray]:
    """One text-to-audio-video request through a deployment of the tiny checkpoint: its uint8
    frames and its 48 kHz stereo samples."""
    from mstar.config import parse_config
    from mstar.runtime.launch import start

    config = {"model": "ltx2_5", "model_path": str(root), "dtype": "float32", "node_groups": node_groups,
              "model_kwargs": {"max_prompt_tokens": 12}}
    d = start(parse_config(config), in_process=in_process)
    try:
        out = asyncio.run(collect(d, "r1"))
    finally:
        d.close()
    frames = np.frombuffer(out["video"], np.uint8).reshape(FRAMES, HEIGHT, WIDTH, 3).astype(np.int16)
    return frames, np.frombuffer(out["audio"], "<i2").astype(np.int32)


@pytest.fixture(scope="module")
def one_rank_clip(checkpoint) -> tuple[np.ndarray, np.ndarray]:
    return clip(checkpoint.root, [], in_process=True)


@pytest.mark.parametrize("split", [{"sp_size": 2}, {"tp_size": 2}], ids=["sp=2", "tp=2"])
def test_a_clip_with_the_dit_over_two_worker_processes_equals_one_rank(checkpoint, one_rank_clip, split):
    """A whole request (Gemma and connectors, the distilled steps over both streams, both
    decoders) with the DiT split over two worker processes gives the single-rank clip."""
    groups = [{"node_names": ["text_encoder", "vae_decoder", "audio_decoder"], "ranks": [0]},
              {"node_names": ["dit"], "ranks": [0, 1], **split}]
    frames, audio = clip(checkpoint.root, groups, in_process=False)
    want_frames, want_audio = one_rank_clip
    assert want_frames.std() > 1 and np.abs(want_audio).max() > 0  # not a flat clip or silence
    assert np.abs(frames - want_frames).max() <= 1  # within one uint8 level
    levels, samples = np.abs(frames - want_frames).max(), np.abs(audio - want_audio).max()
    print(f"[ltx2_5] {split}: frames {levels} uint8 levels, audio {samples} 16-bit steps off one rank")
    # the walk's audio bar against diffusers: the tiny random vocoder drives most samples to full
    # scale, so the DiT's ~1e-7 differences surface as a few 16-bit steps
    assert audio.shape == want_audio.shape and samples / 32767 <= 1e-4 + 1 / 32767
