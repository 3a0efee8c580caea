"""Qwen3.5 at TP=2 over gloo equals TP=1: a tiny random hybrid model (gated DeltaNet and
gated attention layers, grouped key heads, an odd vocabulary) saved by transformers in the
Hugging Face key layout loads on both through ``Qwen3_5Chat.build_engines`` (as a worker
rank builds it, under the parallel state). The engines then run the same steps: a batched
prefill (one prompt over two DeltaNet chunks), decodes mixed with a third prefill, then
decodes of all three; every step's logits agree within 1e-5 relative (fp32) and the greedy
tokens are the same, with an untied and a tied head. Each rank's KV cache and state slots
hold only its heads. Through the runtime, two worker processes serve the same tokens as one.
The shipped Qwen3.8-27B TP4 config parses and places (the vision tower on the leader,
unsplit), and a split the heads cannot take is refused naming the key. The TP checks run
over NCCL on two GPUs too (``cuda``; skipped without them), in float32 without TF32."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from mstar.config import parse_config
from mstar.distributed import use_parallel
from mstar.engine.base import EngineItem
from mstar.model.qwen3_5.model import LLM, Qwen3_5Chat
from tests.distributed.helpers import (
    devices,
    fp32_only,
    mesh,
    rank_device,
    rel_error,
    run_ranks,
)

TOL = 1e-5
VOCAB = 161  # odd: the last vocabulary shard is padded
DECODE_STEPS = 4
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
PROMPT_LENGTHS = {"a": 70, "b": 5, "c": 13}


def write_checkpoint(path: Path, tied: bool = False) -> Path:
    # Imported here: the spawned ranks import this module, and need no transformers.
    from transformers import Qwen3_5ForCausalLM as HFCausalLM
    from transformers import Qwen3_5TextConfig as HFTextConfig

    model = HFCausalLM(HFTextConfig(**dict(TEXT, tie_word_embeddings=tied)))
    _randomize(model)
    model.save_pretrained(path)
    return path


def write_multimodal_checkpoint(path: Path, vocab_size: int) -> Path:
    """The released layout (``Qwen3_5ForConditionalGeneration``: ``model.language_model.*``,
    ``model.visual.*``) with a one-block vision tower."""
    from transformers import Qwen3_5Config as HFConfig
    from transformers import Qwen3_5ForConditionalGeneration as HFConditional

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=TEXT["hidden_size"], num_position_embeddings=16)
    config = HFConfig(text_config=dict(TEXT, vocab_size=vocab_size), vision_config=vision, image_token_id=5,
                      video_token_id=6, vision_start_token_id=3, vision_end_token_id=4, tie_word_embeddings=False)
    model = HFConditional(config)
    _randomize(model)
    model.save_pretrained(path)
    return path


def _randomize(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large weights: clear greedy choices; gates and decays far from trivial
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(0.3 * noise if param.ndim == 1 else 0.15 * noise)
            if name.endswith("linear_attn.norm.weight"):
                param.add_(1.0)


def _spec(folder: str) -> Qwen3_5Chat:
    return Qwen3_5Chat(parse_config({
        "model": "qwen3_5_4b", "model_path": folder, "dtype": "float32", "max_seq_len": 128,
        "max_concurrent_requests": 3,
        "resources": {"kv_cache": {"max_num_pages": 40, "page_size": 8}, "gdn_state": {"max_slots": 4}}}))


@torch.no_grad()
def run_steps(folder: str, device: torch.device) -> dict:
    """Logits (on the CPU) and greedy tokens of every step, and the per-rank cache and state
    shapes, the engine on ``device``."""
    engine = _spec(folder).build_engines({LLM}, device)[LLM]
    model = engine.model
    recorded: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.cpu().clone())
        return logits

    model.compute_logits = recording
    gen = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(0, VOCAB, (n,), generator=gen) for rid, n in PROMPT_LENGTHS.items()}
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 64}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    logits: list[torch.Tensor] = []

    def step(requests: list[str]) -> None:
        items = [EngineItem(rid, "decode", 0, {"token": torch.tensor([tokens[rid][-1]])}, params) if tokens[rid]
                 else EngineItem(rid, "prefill", 0, {"prompt_ids": prompts[rid]}, params) for rid in requests]
        for rid, out in zip(requests, engine.run(items)):
            tokens[rid].append(int(out.outputs["token"]))
        logits.append(recorded[-1])

    step(["a", "b"])
    step(["b", "a", "c"])
    for _ in range(DECODE_STEPS):
        step(["a", "b", "c"])
    return {"logits": logits, "tokens": tokens,
            "kv_heads": engine.kv_caches[0].shape[-2],  # [2, pages, page_size, kv_heads, head_dim]
            "conv": tuple(engine.forward.conv_states[0].shape),
            "recurrent": tuple(engine.forward.recurrent_states[0].shape)}


def _compare(rank: int, world: int, folders: list[str], device_kind: str = "cpu") -> list[dict]:
    device = rank_device(device_kind, rank)
    results = []
    for folder in folders:
        reference = run_steps(folder, device)  # TP=1: no parallel state
        with use_parallel(mesh(world)):
            split = run_steps(folder, device)
        results.append({"reference": reference, "split": split,
                        "errors": [rel_error(ours, ref) for ours, ref in zip(split["logits"], reference["logits"])]})
    return results


@pytest.mark.parametrize("device", devices(2))
def test_qwen3_5_at_tp2_equals_tp1(tmp_path, device):
    kinds = ("untied", "tied")  # a tied head takes its logits from the vocabulary-parallel embeddings
    folders = [str(write_checkpoint(tmp_path / kind, tied=kind == "tied")) for kind in kinds]
    world = 2
    per_rank = run_ranks(_compare, world, folders, device, device=device)
    for rank, (kind, result) in ((r, k) for r, results in enumerate(per_rank) for k in zip(kinds, results)):
        reference, split = result["reference"], result["split"]
        # per slot: conv window (kernel - 1, q + k + v channels), recurrent (value heads, K, V)
        assert reference["conv"] == (4, 3, 2 * 2 * 16 + 4 * 8) and split["conv"] == (4, 3, (2 * 2 * 16 + 4 * 8) // 2)
        assert reference["recurrent"] == (4, 4, 16, 8) and split["recurrent"] == (4, 2, 16, 8)
        assert (reference["kv_heads"], split["kv_heads"]) == (2, 1)
        assert len(result["errors"]) == 2 + DECODE_STEPS
        for i, err in enumerate(result["errors"]):
            print(f"[qwen3.5 tp={world} {device} rank {rank} {kind}] step {i}: max rel err {err:.2e}")
            assert err <= TOL, f"rank {rank} {kind} step {i}: {err:.3e}"
        assert split["tokens"] == reference["tokens"]
        assert all(len(t) == 1 + DECODE_STEPS + (rid != "c") for rid, t in reference["tokens"].items())
    for results in zip(*per_rank):  # both ranks sampled the same, and each prompt went its own way
        assert results[0]["split"]["tokens"] == results[1]["split"]["tokens"]
        assert len({tuple(t) for t in results[0]["reference"]["tokens"].values()}) == 3


def test_parallel_dims_refuse_what_tp_cannot_split(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(TEXT, model_type="qwen3_5_text")))
    dims = _spec(str(folder)).parallel_dims()
    assert set(dims) == {LLM}  # the vision tower is never split
    assert dims[LLM].problems(2, 1) == []
    assert dims[LLM].problems(4, 1) == ["tp_size 4 does not divide num_key_value_heads (2)",
                                        "tp_size 4 does not divide linear_num_key_heads (2)"]


QWEN3_8_27B = {  # the shapes of Qwen3.8-27B (the Qwen3.5-27B architecture), text config
    "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {"vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
                    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144},
}


def test_qwen3_8_27b_tp4_config_places(tmp_path):
    import yaml

    from mstar.model.registry import model_class
    from mstar.runtime.placement import build_placement

    folder = tmp_path / "qwen3_8_27b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_8_27B))
    raw = yaml.safe_load((Path(__file__).parents[2] / "configs" / "qwen3_8_27b_tp4.yaml").read_text())
    config = parse_config(raw | {"model_path": str(folder)})
    assert (config.model, config.device, config.dtype) == ("qwen3_8_27b", "cuda", "bfloat16")
    spec = model_class(config.model)(config)
    placement = build_placement(spec.graph(), config, spec)
    (llm,) = placement.split_groups()
    assert (llm.node_names, llm.ranks, llm.tp_size) == (("llm",), (0, 1, 2, 3), 4)
    assert placement.followers() == {1, 2, 3}
    assert spec.default_capacity()["state_slots"] >= config.max_concurrent_requests
    # a split that does not divide the KV heads is refused at placement, naming the key
    eight = dict(raw, model_path=str(folder), gpus=list(range(8)),
                 node_groups=[raw["node_groups"][0], {"node_names": ["llm"], "ranks": list(range(8)), "tp_size": 8}])
    config = parse_config(eight)
    with pytest.raises(ValueError, match=r"node_groups\[1\]\.tp_size.*tp_size 8 does not divide num_key_value_heads"):
        build_placement(spec.graph(), config, model_class(config.model)(config))


@pytest.mark.parametrize("device", devices(2))
def test_tp2_process_workers_match_tp1(tmp_path, device):
    """Through the runtime, a checkpoint in the released multimodal layout: ``llm`` split over
    two worker processes (the vision tower on the leader, unsplit) serves three concurrent
    greedy requests with the same tokens as the in-process TP=1 deployment, and every KV
    page and state slot comes back. On ``cuda`` the TP=1 deployment runs on GPU 0 and the
    split one on GPUs 0 and 1 over NCCL, all in float32 without TF32."""
    from transformers import PreTrainedTokenizerFast

    from benchmarks.common import tiny_llama_dir
    from mstar.model.spec import WalkRequest
    from mstar.runtime.launch import start
    from tests.distributed.test_tp_runtime import CHAT_TEMPLATE, Outcome

    folder = tmp_path / "ckpt"
    tiny_llama_dir(folder, vocab_size=VOCAB + 140)  # a tokenizer; its config.json is replaced below
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    write_multimodal_checkpoint(folder, vocab_size=VOCAB + 140)

    def config(node_groups: list[dict]) -> dict:
        return {"model": "qwen3_5_4b", "model_path": str(folder), "device": device, "dtype": "float32",
                "max_seq_len": 128, "max_concurrent_requests": 3, "node_groups": node_groups,
                "resources": {"kv_cache": {"max_num_pages": 40, "page_size": 8}, "gdn_state": {"max_slots": 4}}}

    def generate(deployment, tag: str) -> list[list[int]]:
        gen = torch.Generator().manual_seed(9)
        outs = []
        for i, (length, max_tokens) in enumerate(((70, 6), (5, 8), (13, 7))):
            prompt = torch.randint(0, VOCAB, (length,), generator=gen)
            params = {"sampling": {"temperature": 0.0}, "max_new_tokens": max_tokens,
                      "max_decode_steps": max_tokens - 1, "stop_token_ids": []}
            request = WalkRequest("chat", {"prompt_ids": prompt}, params,
                                  {"kv_pages": -(-(length + max_tokens) // 8), "state_slots": 1},
                                  prompt_tokens=length)
            out = Outcome()
            deployment.runtime.submit(f"{tag}-{i}", request, deployment.spec.output_stream(request, []), out)
            outs.append(out)
        for out in outs:
            assert out.done.wait(120), "a request did not finish"
            assert out.error is None, out.error
        return [out.token_ids for out in outs]

    with fp32_only(device):  # the TP=1 deployment runs in this process, the TP=2 one in workers
        reference = start(parse_config(config([])), in_process=True)
        try:
            expected = generate(reference, "tp1")
        finally:
            reference.close()
        assert [len(t) for t in expected] == [6, 8, 7]
        assert len({tuple(t) for t in expected}) == 3  # the prompts lead somewhere different
        # the placement of the Qwen3.8 TP4 config: the vision tower on the leader, unsplit
        split = start(parse_config(config([{"node_names": ["vision"], "ranks": [0]},
                                           {"node_names": ["llm"], "ranks": [0, 1], "tp_size": 2}])))
        try:
            assert generate(split, "tp2") == expected
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                gauges = split.runtime.rank_gauges.get(0, {})
                if split.runtime.conductor.idle and gauges.get("llm.state_slots_used") == 0:
                    break
                time.sleep(0.05)
            assert (gauges.get("llm.kv_pages_used"), gauges.get("llm.state_slots_used")) == (0, 0)
        finally:
            split.close()
