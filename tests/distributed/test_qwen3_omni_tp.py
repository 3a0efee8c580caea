"""Qwen3-Omni at TP=2 over gloo equals TP=1 (fp32, CPU, tiny random configs).

One checkpoint directory in the released layout holds a tiny thinker (experts stored apart)
and a tiny talker (experts stacked as transformers 5 saves them). Two ranks each build and
load it under the parallel state, as worker ranks do, and run the same work as one process:
``SparseMoE`` with and without a shared expert (1e-5), the thinker's logits over a batched
prefill and two decode steps, the talker's codec logits and the code predictor's greedy frame
(1e-5 relative); each rank holds its shard of every split weight, from either layout; all of
it in one pair of processes. A config whose sizes ``tp_size`` cannot split is refused naming
the ``config.json`` key, and ``configs/qwen3_omni_tp2.yaml`` places. Served through two worker
processes (the runtime's lockstep), a text chat and a spoken one equal the TP=1 deployment's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mstar.distributed import SINGLE, use_parallel
from mstar.layers.moe import SparseMoE
from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniCheckpoint
from mstar.model.weights import load_weights
from tests.distributed.helpers import mesh, rel_error, run_ranks
from tests.support.pages import Pages

pytest.importorskip("transformers.models.qwen3_omni_moe")

TOL = 1e-5
HIDDEN = 64
PROMPTS = [("a", 7), ("b", 11)]
DECODE_STEPS = 2


def write_checkpoint(path: Path) -> Path:
    """The released layout: ``config.json`` with both parts' configs and one safetensors file."""
    # Imported here: the spawned ranks import this module, and need no transformers.
    from safetensors.torch import save_file

    from tests.support.qwen3_omni import reference_talker, reference_thinker, released_keys

    thinker, talker = reference_thinker(seed=3), reference_talker(seed=4)
    tensors = dict(released_keys(thinker))  # experts apart
    tensors |= {f"talker.{name}": t for name, t in talker.state_dict().items()}  # experts stacked
    path.mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe",
                                                  "thinker_config": thinker.config.to_dict(),
                                                  "talker_config": talker.config.to_dict()}))
    return path


def moe_tensors(shared: int, stacked: bool) -> dict[str, torch.Tensor]:
    """Full random weights of a ``SparseMoE`` (H 64, 8 experts of 32, top 3), per-expert keys
    or stacked ones."""
    gen = torch.Generator().manual_seed(11 + shared)
    experts, inner = 8, 32
    gate_up = 0.1 * torch.randn(experts, 2 * inner, HIDDEN, generator=gen)
    down = 0.1 * torch.randn(experts, HIDDEN, inner, generator=gen)
    out = {"gate.weight": 0.3 * torch.randn(experts, HIDDEN, generator=gen)}
    if stacked:
        out |= {"experts.gate_up.weight": gate_up, "experts.down.weight": down}
    else:
        for i in range(experts):
            out |= {f"experts.{i}.gate_proj.weight": gate_up[i, :inner],
                    f"experts.{i}.up_proj.weight": gate_up[i, inner:], f"experts.{i}.down_proj.weight": down[i]}
    if shared:
        out |= {f"shared_expert.{p}.weight": 0.1 * torch.randn(shape, generator=gen) for p, shape in
                (("gate_proj", (shared, HIDDEN)), ("up_proj", (shared, HIDDEN)), ("down_proj", (HIDDEN, shared)))}
        out["shared_expert_gate.weight"] = 0.3 * torch.randn(1, HIDDEN, generator=gen)
    return out


@torch.no_grad()
def work(rank: int, world: int, folder: str) -> dict:
    """Everything compared, built under a ``world``-way TP state (``SINGLE`` for one)."""
    state = mesh(world) if world > 1 else SINGLE
    out: dict = {}
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(5))
    for shared, stacked in ((0, False), (48, True)):
        with use_parallel(state):
            moe = SparseMoE(HIDDEN, 32, 8, 3, True, shared_inner=shared)
        load_weights(moe, moe_tensors(shared, stacked).items())
        out[f"moe{shared}"] = moe(x)

    ckpt = Qwen3OmniCheckpoint(Path(folder))
    with use_parallel(state):
        thinker = ckpt.thinker(torch.device("cpu"), torch.float32, dummy=False, seed=0).eval()
        talker = ckpt.talker(torch.device("cpu"), torch.float32, dummy=False, seed=0).eval()
    text = thinker.text
    layer0 = text.model.layers[0]
    out["shards"] = {"thinker.gate_up": layer0.mlp.experts.gate_up.weight.clone(),
                     "thinker.down": layer0.mlp.experts.down.weight.clone(),
                     "thinker.qkv": layer0.self_attn.qkv_proj.weight.clone(),
                     "thinker.dense_gate_up": text.model.layers[1].mlp.gate_up_proj.weight.clone(),
                     "talker.gate_up": talker.model.layers[0].mlp.experts.gate_up.weight.clone(),
                     "talker.down": talker.model.layers[0].mlp.experts.down.weight.clone(),
                     "talker.shared_down": talker.model.layers[0].mlp.shared_expert.down_proj.weight.clone(),
                     "thinker.audio_fc1": thinker.audio_tower.layers[0].fc1.weight.clone()}
    out["thinker_cache"] = text.cache_shape()

    layers, heads, head_dim = text.cache_shape()
    caches, pages = allocate_kv_cache(layers, 16, 4, heads, head_dim, torch.float32, "cpu"), Pages(16, 4, seed=2)
    gen = torch.Generator().manual_seed(6)
    ids = torch.cat([torch.randint(0, 140, (n,), generator=gen) for _, n in PROMPTS])
    steps = [text.compute_logits(text(ids, pages.step(PROMPTS), caches))]
    for _ in range(DECODE_STEPS):
        ids = torch.randint(0, 140, (len(PROMPTS),), generator=gen)
        steps.append(text.compute_logits(text(ids, pages.step([(s, 1) for s, _ in PROMPTS]), caches)))
    out["thinker"] = steps

    layers, heads, head_dim = talker.cache_shape()
    caches, pages = allocate_kv_cache(layers, 16, 4, heads, head_dim, torch.float32, "cpu"), Pages(16, 4, seed=3)
    embeds = torch.randn(sum(n for _, n in PROMPTS), HIDDEN, generator=gen)
    hidden = talker(embeds, pages.step(PROMPTS), caches)
    steps = [talker.compute_logits(hidden)]
    for _ in range(DECODE_STEPS):
        hidden = talker(torch.randn(len(PROMPTS), HIDDEN, generator=gen), pages.step([(s, 1) for s, _ in PROMPTS]),
                        caches)
        steps.append(talker.compute_logits(hidden))
    out["talker"] = steps
    frame = talker.predict_frame(hidden, steps[-1].argmax(dim=-1))
    out["frame"] = (frame.codes, frame.embeds)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, list[dict], Path]:
    folder = write_checkpoint(tmp_path_factory.mktemp("omni") / "ckpt")
    return work(0, 1, str(folder)), run_ranks(work, 2, str(folder)), folder


@pytest.mark.parametrize("shared", [0, 48])
def test_sparse_moe_tp2_equals_tp1(results, shared):
    one, ranks, _ = results
    for rank in ranks:
        assert (rank[f"moe{shared}"] - one[f"moe{shared}"]).abs().max().item() <= TOL


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_logits_tp2_equal_tp1(results, part):
    """Prefill of two prompts, then two decode steps: every step's logits on both ranks."""
    one, ranks, _ = results
    assert len(one[part]) == 1 + DECODE_STEPS
    for rank in ranks:
        for step, (ours, ref) in enumerate(zip(rank[part], one[part])):
            assert rel_error(ours, ref) <= TOL, (part, step)


def test_code_predictor_frame_tp2_equals_tp1(results):
    one, ranks, _ = results
    for rank in ranks:
        assert torch.equal(rank["frame"][0], one["frame"][0])
        assert rel_error(rank["frame"][1], one["frame"][1]) <= TOL


def test_each_rank_loads_its_shard(results):
    """Per-expert (thinker) and stacked (talker) experts, the dense layer and the shared expert
    split by features; attention by whole heads; the audio tower whole on every rank."""
    from safetensors.torch import load_file

    one, ranks, folder = results
    full = load_file(str(folder / "model.safetensors"))
    inner, shared = 32, 48
    t = "thinker.model.layers.0.mlp.experts"
    assert ranks[0]["thinker_cache"] == (3, 1, 16) and one["thinker_cache"] == (3, 2, 16)
    for rank, got in enumerate(r["shards"] for r in ranks):
        rows = slice(rank * inner // 2, (rank + 1) * inner // 2)
        for e in (0, 5):
            assert torch.equal(got["thinker.gate_up"][e], torch.cat((full[f"{t}.{e}.gate_proj.weight"][rows],
                                                                     full[f"{t}.{e}.up_proj.weight"][rows])))
            assert torch.equal(got["thinker.down"][e], full[f"{t}.{e}.down_proj.weight"][:, rows])
        stacked_gate_up = full["talker.model.layers.0.mlp.experts.gate_up_proj"]
        gate, up = stacked_gate_up.chunk(2, dim=1)
        assert torch.equal(got["talker.gate_up"], torch.cat((gate[:, rows], up[:, rows]), dim=1))
        assert torch.equal(got["talker.down"], full["talker.model.layers.0.mlp.experts.down_proj"][:, :, rows])
        half = slice(rank * shared // 2, (rank + 1) * shared // 2)
        assert torch.equal(got["talker.shared_down"],
                           full["talker.model.layers.0.mlp.shared_expert.down_proj.weight"][:, half])
        q = full["thinker.model.layers.0.self_attn.q_proj.weight"]  # 4 heads of 16: two per rank
        assert torch.equal(got["thinker.qkv"][:32], q[rank * 32:(rank + 1) * 32])
        assert got["thinker.dense_gate_up"].shape == (96, HIDDEN)  # [gate | up] of 96 / 2 each
        assert torch.equal(got["thinker.audio_fc1"], full["thinker.audio_tower.layers.0.fc1.weight"])


def test_parallel_dims_name_the_key(results):
    from mstar.model.qwen3_omni.parallel import omni_dims

    _, _, folder = results
    config = json.loads((folder / "config.json").read_text())
    dims = omni_dims(config)
    assert set(dims) == {"thinker", "talker"}  # code2wav is never split
    assert dims["thinker"].problems(2, 1) == [] and dims["talker"].problems(2, 1) == []
    assert dims["thinker"].problems(4, 1) == [
        "tp_size 4 does not divide thinker_config.text_config.num_key_value_heads (2)"]
    assert "tp_size 4 does not divide talker_config.code_predictor_config.num_key_value_heads (2)" in \
        dims["talker"].problems(4, 1)
    assert "tp_size 3 does not divide talker_config.text_config.moe_intermediate_size (32)" in \
        dims["talker"].problems(3, 1)


# ------------------------------------------------------------------ served: two worker processes
SERVED_KWARGS = {"codec_chunk_schedule": [3, 4], "codec_chunk_frames": 5, "codec_left_context": 8,
                 "max_speech_frames": 12, "talker_kv_pages": 64, "max_audio_seconds": 2.0}


def _serve(folder: Path, node_groups: list[dict], in_process: bool) -> list[tuple[list[int], bytes]]:
    """A text chat and a spoken one (greedy) through a deployment: each one's token ids and
    its audio bytes joined."""
    import asyncio

    from mstar.config import parse_config
    from mstar.contract import ChatSpec, SamplingParams
    from mstar.runtime.launch import start

    config = {"model": "qwen3_omni", "model_path": str(folder), "dtype": "float32", "max_seq_len": 128,
              "max_concurrent_requests": 2, "resources": {"kv_cache": {"max_num_pages": 48, "page_size": 16}},
              "node_groups": node_groups, "model_kwargs": SERVED_KWARGS}
    deployment = start(parse_config(config), in_process=in_process)

    async def chat(tag: str, outputs: list[str]) -> tuple[list[int], bytes]:
        spec = ChatSpec(request_id=tag, messages=[{"role": "user", "content": f"hello {tag}"}],
                        sampling=SamplingParams(temperature=0.0), max_tokens=6, output_modalities=outputs,
                        audio={"voice": "tiny", "format": "pcm"} if "audio" in outputs else None)
        ids, audio = [], b""
        async for event in deployment.backend.chat(spec):
            assert event.error is None, event.error
            ids += event.token_ids
            audio += event.data if event.modality == "audio" and event.data else b""
        return ids, audio

    try:
        return [asyncio.run(chat("text", ["text"])), asyncio.run(chat("speech", ["text", "audio"]))]
    finally:
        deployment.close()


def test_served_tp2_equals_tp1(tmp_path):
    """``thinker`` and ``talker`` split over two worker processes (gloo), ``code2wav`` on the
    leader's rank alone, answer a text chat and a spoken one as the in-process TP=1
    deployment does: the same ids, the same audio within 1e-5."""
    import numpy as np

    from tests.support.qwen3_omni_dir import write_checkpoint

    folder = write_checkpoint(tmp_path)
    one = _serve(folder, [{"node_names": ["thinker", "talker", "code2wav"], "ranks": [0]}], in_process=True)
    two = _serve(folder, [{"node_names": ["thinker", "talker"], "ranks": [0, 1], "tp_size": 2},
                          {"node_names": ["code2wav"], "ranks": [0]}], in_process=False)
    (text_ids, no_audio), (speech_ids, audio) = one
    assert len(text_ids) == 6 and not no_audio and len(audio) > 0
    assert [ids for ids, _ in two] == [text_ids, speech_ids]
    assert two[0][1] == b""
    ours, ref = np.frombuffer(two[1][1], "<f4"), np.frombuffer(audio, "<f4")
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-5 * max(np.abs(ref).max(), 1e-6)


def test_tp2_config_places_and_bad_splits_name_the_key(results):
    """``configs/qwen3_omni_tp2.yaml`` places on the CPU (the tiny checkpoint's sizes split two
    ways); a split the KV heads cannot take, and code2wav in a split group, are refused."""
    from mstar.config import load_config, parse_config
    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    _, _, folder = results
    path = Path(__file__).resolve().parents[2] / "configs" / "qwen3_omni_tp2.yaml"
    config = load_config(path, {"device": "cpu", "model_path": str(folder)})
    spec = model_class(config.model)(config)
    placement = build_placement(spec.graph(), config, spec)
    (split,) = placement.split_groups()
    assert (split.node_names, split.ranks, split.tp_size) == (("thinker", "talker"), (0, 1), 2)
    assert placement.followers() == {1}
    for walk, node in (("text", "thinker"), ("speech", "talker"), ("speech", "code2wav")):
        assert placement.rank_of(walk, node) == 0

    raw = config.model_dump()
    four = dict(raw, gpus=None, node_groups=[{"node_names": ["thinker"], "ranks": [0, 1, 2, 3], "tp_size": 4},
                                             {"node_names": ["talker", "code2wav"], "ranks": [0]}])
    config = parse_config(four)
    with pytest.raises(ValueError, match=r"node_groups\[0\]\.tp_size.*tp_size 4 does not divide "
                                         r"thinker_config\.text_config\.num_key_value_heads \(2\)"):
        build_placement(spec.graph(), config, model_class(config.model)(config))
    whole = dict(raw, gpus=None, node_groups=[{"node_names": ["thinker", "talker", "code2wav"], "ranks": [0, 1],
                                               "tp_size": 2}])
    config = parse_config(whole)
    with pytest.raises(ValueError, match=r"node 'code2wav' cannot be split"):
        build_placement(spec.graph(), config, model_class(config.model)(config))
