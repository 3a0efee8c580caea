"""Cosmos3's tower split over two ranks (gloo, 2 processes, float32) equals the unsplit tower.

The tiny checkpoint with both extra pathways (action heads and a ``sound_gen`` tower) loads on
each rank through ``Cosmos3.build_engines`` under the rank's parallel state, at TP=2 and at SP=2.
Three denoise steps of one batch (a guided text-to-video request, an unguided policy request
with sound and an action chunk after a clean first frame, and a guided video request with odd
latent sides) give every step's video, sound and action latents of the one-rank engine within
1e-5 relative on both ranks. The batch's packed media rows are odd in number, so the two SP
slices differ in length (and each request's rows straddle the slices differently); TP=2 halves
both experts' heads and MLP widths, and each rank holds exactly its shard of the checkpoint's
tensors. An Edge-style tower (squared-ReLU MLPs without a gate, Nemotron norms, the separate key
norm for the text keys the media reads) gives the one-rank velocities of two packed requests at
TP=2 and SP=2 likewise, and a Nano-style one (8 heads, 4 KV heads) on a TP=2 x SP=2 mesh of four
processes (27 rows: uneven slices). Through the runtime, with the ``dit`` node over two worker processes
(``sp_size: 2``, then ``tp_size: 2``), a guided text-to-video request with sound and an unguided
one sharing its forwards give the one-rank deployment's frames within one uint8 level (measured
0) and its PCM within four 16-bit steps (measured 1). ``window_mode: kv`` on the engine, at TP=2
and SP=2: a guided 2-window rollout in a session beside an unguided one without (27 rows a
step), then a 1-window resume of the session, give every step's latents within 1e-5 of one rank
(measured 2e-6) and each rank's committed K/V its KV heads' slice of the one-rank cache (3e-6);
through the runtime at ``tp_size: 2`` a kv session's opening and resume give the one-rank
frames within one uint8 level (measured 1), the book holds each rank's own bytes of the
session (the follower's: its dit shard, 2048; the leader's: its dit shard and the vae's
state), and a killed follower restarts the group and the session is forgotten (410 on
resume). The split limits are declared for the
startup checks (a split that does not divide the KV heads is refused naming the key; the Edge
reasoner is never split) and the two-GPU Super config places.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.config import parse_config
from mstar.distributed import SINGLE, ParallelState, build_mesh, use_parallel
from mstar.engine.base import EngineItem
from mstar.model.cosmos3.config import Cosmos3Config
from mstar.model.cosmos3.layout import media_offset, patch_grid, text_positions, video_positions
from mstar.model.cosmos3.transformer import Cosmos3Transformer, MediaItem
from mstar.model.weights import iter_safetensors, load_weights
from tests.distributed.helpers import check_two_gpu_config, fake_tp_group, rel_error, run_ranks
from tests.support.cosmos3_sound import add_sound_tower
from tests.support.diffusers_dirs import randomize

pytest.importorskip("diffusers")

TOL = 1e-5
STEPS = 3
DOMAIN, RAW_ACTION_DIM, CHUNK = 8, 10, 4
EDGE = dict(head_dim=16, hidden_size=32, intermediate_size=48, latent_channel=4, latent_patch_size=2,
            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
            rope_theta=10000.0, vocab_size=64, rope_axes_dim=[4, 2, 2], unified_3d_mrope_temporal_modality_margin=50,
            hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True)
MESH = dict(EDGE, hidden_act="silu", qk_norm_for_text=True, use_und_k_norm_for_gen=False,
            num_attention_heads=8, num_key_value_heads=4, hidden_size=64)  # Nano-style, heads for 4 ranks
SHARDED = ("layers.0.self_attn.add_q_proj.weight", "layers.1.self_attn.to_k.weight",
           "layers.0.self_attn.to_add_out.weight", "layers.1.mlp_moe_gen.down_proj.weight",
           "layers.0.mlp.gate_proj.weight")


@pytest.fixture(scope="module")
def both(action_checkpoint, tmp_path_factory) -> Path:
    """The action checkpoint with a ``sound_gen`` tower and a ``sound_tokenizer/``."""
    root = tmp_path_factory.mktemp("cosmos3-parallel") / "ckpt"
    add_sound_tower(action_checkpoint, root, 5)
    return root


def spec(root: Path, model: str = "cosmos3_droid"):
    from mstar.model.registry import model_class

    config = parse_config({"model": model, "model_path": str(root), "dtype": "float32",
                           "model_kwargs": {"num_inference_steps": STEPS}})
    return model_class(model)(config)


def requests() -> list[tuple[str, dict, dict]]:
    """(id, inputs, params) of three requests: guided t2v (2 x 3 x 5 latents: 12 rows), a policy
    with sound (5 sound rows, 4 actions, frame 0 clean) and guided v2v-like with odd sides (3 x 3 x 3:
    12 rows, frame 0 clean); 12 + 12 + (12 + 5 + 4) + 12 + 12 = 69 media rows in the step."""
    g = torch.Generator().manual_seed(3)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 60, (n,), generator=g)

    t2v = ({"latents": torch.randn(4, 2, 3, 5, generator=g), "prompt_ids": ids(9), "negative_ids": ids(6)},
           {"num_steps": STEPS, "guidance_scale": 4.0, "fps": 24.0})
    latents = torch.randn(4, 2, 4, 4, generator=g)
    actions = torch.randn(CHUNK, 12, generator=g)
    actions[:, RAW_ACTION_DIM:] = 0
    policy = ({"latents": latents, "prompt_ids": ids(7), "cond_latents": torch.randn(4, 1, 4, 4, generator=g),
               "sound_latents": torch.randn(4, 5, generator=g), "action_latents": actions},
              {"num_steps": STEPS, "fps": 16.0, "action_mode": "policy", "action_domain": DOMAIN,
               "raw_action_dim": RAW_ACTION_DIM})
    odd = ({"latents": torch.randn(4, 3, 3, 3, generator=g), "prompt_ids": ids(5), "negative_ids": ids(8),
            "cond_latents": torch.randn(4, 1, 3, 3, generator=g)},
           {"num_steps": STEPS, "guidance_scale": 2.5, "fps": 24.0})
    return [(name, *req) for name, req in (("t2v", t2v), ("policy", policy), ("odd", odd))]


def denoise(root: Path, state: ParallelState) -> tuple[list[dict[str, dict[str, torch.Tensor]]], object]:
    """Every step's outputs per request, the batch denoised together on the ``dit`` engine
    built under ``state``; and the engine's tower."""
    with use_parallel(state):
        engine = spec(root).build_engines({"dit"}, torch.device("cpu"))["dit"]
    reqs = requests()
    inputs = {rid: dict(i) for rid, i, _ in reqs}
    steps = []
    for step in range(STEPS):
        outs = engine.run([EngineItem(rid, "step", step, inputs[rid], params) for rid, _, params in reqs])
        steps.append({rid: out.outputs for (rid, _, _), out in zip(reqs, outs)})
        for (rid, _, _), out in zip(reqs, outs):
            inputs[rid].update(out.outputs)
    for rid, _, _ in reqs:
        engine.release(rid)
    return steps, engine.tower


def write_tower(config: dict, folder: Path) -> Path:
    """A tower of ``config`` with random weights, saved as ``folder/tower.safetensors``."""
    from safetensors.torch import save_file

    tower = Cosmos3Transformer(Cosmos3Config.from_dict(config))
    randomize(tower, 9)
    path = folder / "tower.safetensors"
    save_file({k: v.contiguous() for k, v in tower.state_dict().items()}, path)
    return path


@pytest.fixture(scope="module")
def edge_tower(tmp_path_factory) -> Path:
    """An Edge-style tower's weights (our names: diffusers')."""
    return write_tower(EDGE, tmp_path_factory.mktemp("cosmos3-edge-tower"))


def velocities(path: Path, state: ParallelState, tower_config: dict = EDGE) -> list[torch.Tensor]:
    """The tower of ``tower_config`` built under ``state`` and loaded from ``path``: the video
    velocities of two requests packed in one step (27 rows: a t2v, one with a clean first frame and
    odd sides)."""
    from safetensors.torch import load_file

    config = Cosmos3Config.from_dict(tower_config)
    with use_parallel(state):
        tower = Cosmos3Transformer(config)
    load_weights(tower, load_file(path).items())
    g = torch.Generator().manual_seed(4)
    items = []
    for shape, text, noisy, t in (((4, 3, 2, 6), 8, [0, 1, 2], 700.0), ((4, 3, 3, 5), 5, [1, 2], 300.0)):
        ids = torch.randint(0, 64, (text,), generator=g)
        offset = media_offset(config, text)
        with torch.no_grad():
            kv = tower.encode_text(ids, text_positions(config, text))
        positions = video_positions(config, patch_grid(config, shape), offset, 24.0)
        items.append(MediaItem(torch.randn(*shape, generator=g), t, noisy, positions, kv))
    with torch.no_grad():
        return tower(items)


def _split_runs(rank: int, world: int, root: Path, edge: Path) -> dict:
    result: dict = {}
    for name, (tp, sp) in {"tp=2": (2, 1), "sp=2": (1, 2)}.items():
        steps, tower = denoise(root, build_mesh(range(2), tp, sp))
        params = dict(tower.named_parameters())
        result[name] = {"steps": steps, "shards": {key: params[key].detach().clone() for key in SHARDED},
                        "edge": velocities(edge, build_mesh(range(2), tp, sp))}
    return result


def test_denoise_at_tp2_and_sp2_equals_one_rank(both, edge_tower):
    expected, _ = denoise(both, SINGLE)
    edge = velocities(edge_tower, SINGLE)
    full = dict(iter_safetensors(both / "transformer"))
    for rank, result in enumerate(run_ranks(_split_runs, 2, both, edge_tower, timeout=90)):
        for name, run in result.items():
            for i, (ours, ref) in enumerate(zip(run["edge"], edge, strict=True)):
                err = rel_error(ours, ref)
                print(f"[cosmos3 rank {rank}] {name} edge-style tower item {i}: max rel err {err:.2e}")
                assert err <= TOL, (rank, name, "edge", i, err)
            for step, (ours, ref) in enumerate(zip(run["steps"], expected)):
                for rid, outputs in ref.items():
                    assert set(ours[rid]) == set(outputs)
                    for key, value in outputs.items():
                        err = rel_error(ours[rid][key], value)
                        print(f"[cosmos3 rank {rank}] {name} step {step} {rid} {key}: max rel err {err:.2e}")
                        assert err <= TOL, (rank, name, step, rid, key, err)
            for key, shard in run["shards"].items():  # each rank holds its own shard of the checkpoint's tensor
                whole = full[key]
                if name == "sp=2":
                    assert torch.equal(shard, whole), (rank, key)
                    continue
                dim = 1 if key.endswith(("to_add_out.weight", "down_proj.weight")) else 0
                assert torch.equal(shard, whole.chunk(2, dim=dim)[rank]), (rank, key)
    first = expected[0]
    assert rel_error(first["policy"]["action_latents"], requests()[1][1]["action_latents"]) > 1e-3  # actions moved
    assert "sound_latents" in first["policy"] and "sound_latents" not in first["t2v"]


def kv_rollouts(root: Path, state: ParallelState) -> dict:
    """``window_mode: kv`` on the ``dit`` engine built under ``state``: a guided 2-window rollout
    ``world`` (3x5 latents: 12 rows a guidance row) in a session, so its last window commits too,
    beside an unguided 2-window one without a session (3 latent frames of 2x2: 3 rows, keeping 1
    committed frame), 27 rows a step; then a 1-window resume of the session. Every step's latents
    per request, the session's committed K/V after the opening and after the resume, and the other
    rollout's after its first window."""
    from mstar.runtime.sessions import SessionHandle, SessionStore

    with use_parallel(state):
        engine = spec(root).build_engines({"dit"}, torch.device("cpu"))["dit"]
    store = SessionStore()
    g = torch.Generator().manual_seed(11)
    world = {"prompt_ids": torch.randint(0, 60, (9,), generator=g), "negative_ids": torch.randint(0, 60, (6,),
                                                                                                  generator=g)}
    other = {"prompt_ids": torch.randint(0, 60, (7,), generator=g)}
    noise = {"world": torch.randn(3, 4, 2, 3, 5, generator=g), "other": torch.randn(2, 4, 3, 2, 2, generator=g)}
    base = {"num_steps": STEPS, "fps": 24.0, "window_mode": "kv"}
    jobs = {"world": (world, {**base, "guidance_scale": 4.0, "num_windows": 2, "context_latents": 0},
                      SessionHandle(store, "world", "dit", resume=False)),
            "other": (other, {**base, "num_windows": 2, "context_latents": 1}, None)}
    steps, caches = [], {}

    def window(w: int, jobs: dict, noise_at) -> None:
        inputs = {rid: {**texts, "latents": noise_at(rid), "cond_latents": noise_at(rid)[:, :0]}
                  for rid, (texts, _, _) in jobs.items()}
        for step in range(STEPS):
            outs = engine.run([EngineItem(rid, "step", step, dict(inputs[rid]), params, session=session)
                               for rid, (_, params, session) in jobs.items()])
            steps.append({rid: out.outputs["latents"] for rid, out in zip(jobs, outs)})
            for rid, out in zip(jobs, outs):
                inputs[rid]["latents"] = out.outputs["latents"]

    def layers(kv) -> list:
        return [[(k.clone(), v.clone()) for k, v in row] for row in kv.layers]

    for w in range(2):
        window(w, jobs, lambda rid, w=w: noise[rid][w])
        if w == 0:
            caches["other"] = layers(engine.committed["other"])
    for rid in jobs:
        engine.release(rid)
    caches["opened"] = layers(store.get("world", "dit"))
    resume = {"world-2": (world, {**jobs["world"][1], "num_windows": 1},
                          SessionHandle(store, "world", "dit", resume=True))}
    window(0, resume, lambda rid: noise["world"][2])
    engine.release("world-2")
    caches["resumed"] = layers(store.get("world", "dit"))
    return {"steps": steps, "caches": caches, "frames": store.get("world", "dit").frames}


def _kv_runs(rank: int, world: int, root: Path) -> dict:
    return {name: kv_rollouts(root, build_mesh(range(2), tp, sp))
            for name, (tp, sp) in {"tp=2": (2, 1), "sp=2": (1, 2)}.items()}


def test_kv_windows_at_tp2_and_sp2_equal_one_rank(both):
    """A ``window_mode: kv`` rollout split over two ranks (gloo): every step's latents of both
    rollouts within 1e-5 relative of the one-rank engine's on both ranks, and each rank's
    committed K/V (the session's after its opening and its resume, the other rollout's after
    its first window) the one-rank cache's slice of this rank's KV heads, within 1e-5 (TP keeps
    its heads' shard; Ulysses hands each SP rank every row of its heads' slice)."""
    expected = kv_rollouts(both, SINGLE)
    assert expected["frames"] == 6 and len(expected["steps"]) == 3 * STEPS
    assert expected["caches"]["other"][0][0][0].shape[0] == 1 * 1  # one 2x2 frame (1 patch) kept
    for rank, result in enumerate(run_ranks(_kv_runs, 2, both, timeout=90)):
        for name, run in result.items():
            assert run["frames"] == expected["frames"]
            for n, (ours, ref) in enumerate(zip(run["steps"], expected["steps"], strict=True)):
                for rid, latents in ref.items():
                    err = rel_error(ours[rid], latents)
                    print(f"[cosmos3 kv rank {rank}] {name} step {n} {rid}: max rel err {err:.2e}")
                    assert err <= TOL, (rank, name, n, rid, err)
            worst = 0.0
            for which, cache in expected["caches"].items():
                for row, (ours_row, ref_row) in enumerate(zip(run["caches"][which], cache, strict=True)):
                    for layer, (ours_kv, ref_kv) in enumerate(zip(ours_row, ref_row, strict=True)):
                        for ours, ref in zip(ours_kv, ref_kv):
                            shard = ref.chunk(2, dim=1)[rank]
                            assert ours.shape == shard.shape, (rank, name, which, row, layer)
                            worst = max(worst, rel_error(ours, shard))
            print(f"[cosmos3 kv rank {rank}] {name} committed K/V: max rel err {worst:.2e}")
            assert worst <= TOL, (rank, name, worst)


def _mesh_runs(rank: int, world: int, path: Path) -> list[torch.Tensor]:
    return velocities(path, build_mesh(range(4), 2, 2), MESH)


def test_tower_on_a_tp2_by_sp2_mesh_equals_one_rank(tmp_path):
    """Four processes: TP pairs within each sequence slice, the all-to-all across them (8 heads,
    4 KV heads, so each rank attends 2 heads and 1 KV head of every row)."""
    path = write_tower(MESH, tmp_path)
    expected = velocities(path, SINGLE, MESH)
    for rank, result in enumerate(run_ranks(_mesh_runs, 4, path, timeout=90)):
        for i, (ours, ref) in enumerate(zip(result, expected, strict=True)):
            err = rel_error(ours, ref)
            print(f"[cosmos3 rank {rank}] tp=2 x sp=2 item {i}: max rel err {err:.2e}")
            assert err <= TOL, (rank, i, err)


def test_cosmos3_declares_what_its_tower_splits(both):
    dims = spec(both).parallel_dims()
    assert set(dims) == {"dit"}  # the VAE, the sound decoder and the reasoner run whole
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
    assert dims["dit"].tensor == {**heads, "intermediate_size": 48} and dims["dit"].sequence == heads
    assert dims["dit"].problems(2, 1) == [] and dims["dit"].problems(1, 2) == []
    assert dims["dit"].problems(1, 4) == ["tp_size x sp_size (4) does not divide num_key_value_heads (2)"]


@pytest.mark.parametrize("group, message", [
    ({"node_names": ["dit"], "ranks": [0, 1, 2, 3], "tp_size": 4},
     "node_groups[1].tp_size: node 'dit': tp_size 4 does not divide num_key_value_heads (2)"),
    ({"node_names": ["dit"], "ranks": [0, 1, 2, 3], "sp_size": 4},
     "node_groups[1].sp_size: node 'dit': tp_size x sp_size (4) does not divide num_key_value_heads (2)"),
])
def test_a_split_that_does_not_divide_the_heads_is_refused_at_startup(both, group, message):
    from mstar.runtime.placement import build_placement

    config = parse_config({"model": "cosmos3_droid", "model_path": str(both),
                           "node_groups": [{"node_names": ["vae", "sound"], "ranks": [0]}, group]})
    model = spec(both)
    with pytest.raises(ValueError) as err:
        build_placement(model.graph(), config, model)
    assert message in str(err.value)


def test_the_edge_reasoner_is_not_split(both):
    from mstar.model.cosmos3.engine import cosmos3_engines
    from mstar.runtime.placement import build_placement

    edge = spec(both, "cosmos3_edge")
    config = parse_config({"model": "cosmos3_edge", "model_path": str(both), "node_groups": [
        {"node_names": ["vae", "sound", "vision"], "ranks": [0]},
        {"node_names": ["dit", "llm"], "ranks": [0, 1], "tp_size": 2}]})
    with pytest.raises(ValueError, match=r"node_groups\[1\].tp_size: node 'llm' cannot be split"):
        build_placement(edge.graph(), config, edge)
    apart = parse_config({"model": "cosmos3_edge", "model_path": str(both), "node_groups": [
        {"node_names": ["vae", "sound", "vision", "llm"], "ranks": [0]},
        {"node_names": ["dit"], "ranks": [0, 1], "tp_size": 2}]})
    placement = build_placement(edge.graph(), apart, edge)  # a whole reasoner beside a split tower places
    assert placement.rank_of("chat", "llm") == 0 and placement.rank_of("t2v", "dit") == 0
    state = ParallelState(tp=fake_tp_group(0, 2))  # a direct build under a split: refused before any weight
    with use_parallel(state), pytest.raises(ValueError, match="reasoner .* runs at tp_size 1"):
        cosmos3_engines(edge.checkpoint(), edge.knobs, edge.config, {"dit", "llm"}, torch.device("cpu"))


def test_two_gpu_super_config_splits_the_tower(checkpoint):
    check_two_gpu_config("cosmos3_super_tp2.yaml", str(checkpoint.root), (2, 1), ("t2v_guided", "t2i_guided"))


def clips(root: Path, node_groups: list, in_process: bool) -> list[dict[str, bytes]]:
    """Through a deployment of the checkpoint ``root``: a guided text-to-video request with sound
    and an unguided one sharing its forwards; each one's outputs (raw frames, PCM) by modality."""
    from mstar.contract import GenerateSpec
    from mstar.runtime.launch import start

    config = {"model": "cosmos3", "model_path": str(root), "dtype": "float32", "max_concurrent_requests": 2,
              "node_groups": node_groups, "model_kwargs": {"num_inference_steps": STEPS}}
    d = start(parse_config(config), in_process=in_process)

    async def one(rid: str, **kwargs) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        spec = GenerateSpec(rid, f"a robot arm stacks cups ({rid})", [], ["video"],
                            {"height": 48, "width": 32, "num_frames": 5, "seed": 7, **kwargs})
        async for event in d.backend.generate(spec):
            assert not event.error, event.error
            if event.data:
                out[event.modality] = out.get(event.modality, b"") + event.data
        return out

    async def both_requests():
        return await asyncio.gather(one("sound", guidance_scale=3.0, enable_sound=True),
                                    one("plain", guidance_scale=1.0))

    try:
        return asyncio.run(both_requests())
    finally:
        d.close()


@pytest.fixture(scope="module")
def one_rank_clips(both) -> list[dict[str, bytes]]:
    return clips(both, [], in_process=True)


@pytest.mark.parametrize("split", [{"sp_size": 2}, {"tp_size": 2}], ids=["sp=2", "tp=2"])
def test_clips_with_the_tower_over_two_worker_processes_equal_one_rank(both, one_rank_clips, split):
    """Whole requests (the text pathway, UniPC steps with a guided pair, the sound latents, the VAE
    and the sound decoder) with the ``dit`` node over two worker processes give the one-rank
    deployment's frames within one uint8 level and its PCM within a few 16-bit steps."""
    groups = [{"node_names": ["vae", "sound"], "ranks": [0]}, {"node_names": ["dit"], "ranks": [0, 1], **split}]
    for ours, ref in zip(clips(both, groups, in_process=False), one_rank_clips, strict=True):
        assert set(ours) == set(ref)
        frames, frames_ref = (np.frombuffer(o["video"], np.uint8).astype(np.int16) for o in (ours, ref))
        print(f"[cosmos3 {split}] frames: max diff {np.abs(frames - frames_ref).max()} levels")
        assert frames_ref.std() > 1 and np.abs(frames - frames_ref).max() <= 1
        if "audio" in ref:
            pcm, pcm_ref = (np.frombuffer(o["audio"], np.int16).astype(np.int32) for o in (ours, ref))
            assert pcm.shape == pcm_ref.shape and np.abs(pcm_ref).max() > 100
            print(f"[cosmos3 {split}] pcm: max diff {np.abs(pcm - pcm_ref).max()} of {np.abs(pcm_ref).max()}")
            assert np.abs(pcm - pcm_ref).max() <= 4


def kv_deployment(root: Path, node_groups: list, in_process: bool):
    """A deployment of ``root`` with windowed rollouts on (``window_mode: kv`` sessions)."""
    from mstar.runtime.launch import start

    config = {"model": "cosmos3", "model_path": str(root), "dtype": "float32", "node_groups": node_groups,
              "request_timeout_s": 60, "model_kwargs": {"num_inference_steps": STEPS, "enable_windowed_video": True,
                                                         "max_video_pixels": 64 * 64 * 13}}
    return start(parse_config(config), in_process=in_process)


def kv_clip(d, rid: str, session, frames: int) -> bytes:
    """A guided ``window_mode: kv`` rollout of ``frames`` frames (5 a window) in ``session``:
    its raw frames."""
    from mstar.contract import GenerateSpec

    async def one() -> bytes:
        out = b""
        spec = GenerateSpec(rid, "a drone flies over a town", [], ["video"],
                            {"height": 48, "width": 32, "num_frames": frames, "guidance_scale": 3.0, "seed": 4,
                             "window_mode": "kv", "window_frames": 5}, session=session)
        async for event in d.backend.generate(spec):
            assert not event.error, event.error
            out += event.data or b""
        return out

    return asyncio.run(one())


def kv_session_clips(root: Path, node_groups: list, in_process: bool) -> list[bytes]:
    """Through a deployment of ``root`` with windowed rollouts on: a guided ``window_mode: kv``
    opening of two windows in a session (its last window commits: the kept cache), then a
    one-window resume reading it; each request's raw frames."""
    from mstar.contract import SessionSpec

    d = kv_deployment(root, node_groups, in_process)
    try:
        return [kv_clip(d, "open", SessionSpec("world"), 9),
                kv_clip(d, "resume", SessionSpec("world", resume=True, end=True), 5)]
    finally:
        d.close()


def test_a_kv_session_with_the_tower_over_two_worker_processes_equals_one_rank(both):
    """The split path through the runtime: with ``dit`` over two worker processes (``tp_size:
    2``) the follower keeps its shard of the session's cache, so the opening's last window
    commits on both ranks (it hung on the leader's collectives when the follower's items came
    without their session) and the resume reads it on both: the frames equal the one-rank
    deployment's within one uint8 level."""
    groups = [{"node_names": ["vae", "sound"], "ranks": [0]}, {"node_names": ["dit"], "ranks": [0, 1], "tp_size": 2}]
    ref = kv_session_clips(both, [], in_process=True)
    ours = kv_session_clips(both, groups, in_process=False)
    for name, a, b in zip(("opening", "resume"), ours, ref, strict=True):
        frames, frames_ref = (np.frombuffer(x, np.uint8).astype(np.int16) for x in (a, b))
        assert frames.shape == frames_ref.shape and frames_ref.std() > 1
        print(f"[cosmos3 kv session tp=2] {name} frames: max diff {np.abs(frames - frames_ref).max()} levels")
        assert np.abs(frames - frames_ref).max() <= 1


def test_a_split_kv_session_counts_each_ranks_bytes_and_a_dead_follower_forgets_it(both):
    """``dit`` over two worker processes (``tp_size: 2``): after a kv session's opening, the
    book holds each rank's own bytes (the follower's, reported by its leader, are its shard
    of dit's committed cache, equal to the leader's dit shard: TP halves the KV heads on both;
    the leader's also count the vae's kept state) and ``/metrics``' gauges show the
    follower's store. Killing the follower restarts the whole group with empty
    stores; the book forgets the session with it, so a resume gets 410 naming it (not the
    model's 400 for a kv session without a kept cache)."""
    import os
    import signal
    import time

    from mstar.contract import RequestError, SessionSpec

    groups = [{"node_names": ["vae", "sound"], "ranks": [0]}, {"node_names": ["dit"], "ranks": [0, 1], "tp_size": 2}]
    d = kv_deployment(both, groups, in_process=False)

    def wait_for(condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    try:
        assert kv_clip(d, "open", SessionSpec("world"), 5)  # one window, which commits
        held = d.runtime.sessions.held("world")
        gauges = d.runtime.gauges()
        print(f"[cosmos3 kv session tp=2] bytes held per rank {held}; gauges "
              f"{ {k: v for k, v in gauges.items() if k.endswith('dit.session_bytes')} }")
        # rank 0 also keeps the vae's state: the follower holds only its shard of dit's cache
        assert set(held) == {0, 1} and held[0] == sum(v for k, v in gauges.items()
                                                      if k.startswith("rank0.") and k.endswith(".session_bytes"))
        assert gauges["rank1.dit.session_bytes"] == gauges["rank0.dit.session_bytes"] == held[1] > 0
        assert held[1] < held[0]
        assert gauges["rank1.dit.sessions_held"] == 1.0

        pool = d.runtime.workers
        old = {rank: p.proc.pid for rank, p in pool.ranks.items()}
        os.kill(old[1], signal.SIGKILL)
        wait_for(lambda: not d.runtime.healthy, "the runtime did not notice the dead follower", 30)
        wait_for(lambda: d.runtime.healthy, "the group did not come back", 120)
        assert all(p.proc.pid != old[rank] for rank, p in pool.ranks.items())
        assert "world" not in d.runtime.sessions and "rank1.dit.session_bytes" not in d.runtime.gauges()
        with pytest.raises(RequestError) as err:
            kv_clip(d, "resume", SessionSpec("world", resume=True), 5)
        assert err.value.status == 410 and "'world'" in err.value.message
    finally:
        d.close()
