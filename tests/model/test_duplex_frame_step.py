"""The duplex LLM's frame-synchronous step against transformers: ``NanoEngine`` primes a
system prompt (each of its positions the token's embedding plus the pad's, as NeMo lays it
out), then for each audio frame feeds the frame plus the embedding of the previous agent
token (the pad before the first), greedy. The reference recomputes the whole sequence
of input embeddings with transformers' ``NemotronHForCausalLM`` (no cache) and takes the
argmax at each frame; tokens must agree and the logits within 1e-5 relative (fp32, tiny
random config). Two calls with different frame counts in one plan equal each alone."""

from __future__ import annotations

import pytest
import torch
from transformers import NemotronHConfig as HFConfig
from transformers import NemotronHForCausalLM as HFCausalLM

from mstar.engine.base import EngineItem
from mstar.model.nemotron_duplex.engines import NanoEngine
from mstar.model.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from mstar.model.nemotron_h.checkpoint import load_checkpoint
from mstar.model.nemotron_h.engine import nemotron_h_engine

PAD = 3
TINY = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
            chunk_size=16, layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=2)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    reference = HFCausalLM(HFConfig(hybrid_override_pattern="M*-M-*M", **TINY)).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(1.0)
    ours = NemotronHForCausalLM(NemotronHConfig.from_hf_dict(reference.config.to_dict())).eval()
    load_checkpoint(ours, [("backbone." + k[6:] if k.startswith("model.") else k, v.contiguous())
                           for k, v in reference.state_dict().items()])
    return reference, ours


def nano(ours) -> NanoEngine:
    inner = nemotron_h_engine(ours, max_slots=4, state_dtype=torch.float32, num_pages=40, page_size=8,
                              max_seq_len=256, device=torch.device("cpu"), dtype=torch.float32)
    return NanoEngine(inner, ours, pad_token_id=PAD)


PARAMS = {"sampling": {"temperature": 0.0}, "max_new_tokens": 1 << 30, "stop_token_ids": []}


@torch.no_grad()
def reference_tokens(reference, prompt: list[int], frames: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    embed = reference.get_input_embeddings()
    sequence = [embed(torch.tensor(prompt)) + embed(torch.tensor([PAD]))]
    previous, tokens, logits = PAD, [], []
    for frame in frames:
        sequence.append(frame[None] + embed(torch.tensor([previous])))
        out = reference(inputs_embeds=torch.cat(sequence)[None], use_cache=False).logits[0, -1]
        previous = int(out.argmax())
        tokens.append(previous)
        logits.append(out)
    return tokens, logits


def run_calls(engine: NanoEngine, calls: dict[str, tuple[list[int], list[torch.Tensor]]]) -> dict[str, list[int]]:
    """Prime every call, then feed each call's chunks of frames, the calls' i-th chunks in one plan."""
    engine.run([EngineItem(rid, "prime", 0, {"prompt_ids": torch.tensor(p)}, PARAMS) for rid, (p, _) in calls.items()])
    out = {rid: [] for rid in calls}
    for i in range(max(len(chunks) for _, chunks in calls.values())):
        items = [EngineItem(rid, "frame", i, {"frame": chunks[i]}, PARAMS)
                 for rid, (_, chunks) in calls.items() if i < len(chunks)]
        for item, result in zip(items, engine.run(items)):
            out[item.request_id] += result.outputs["token"].tolist()
    return out


def test_frame_steps_equal_transformers_over_the_whole_sequence(models):
    reference, ours = models
    g = torch.Generator().manual_seed(1)
    frames = torch.randn(9, 32, generator=g)
    prompt = [5, 17, 40, 7]
    want, ref_logits = reference_tokens(reference, prompt, frames)
    engine = nano(ours)
    seen: list[torch.Tensor] = []
    ours.compute_logits = lambda h: seen.append(NemotronHForCausalLM.compute_logits(ours, h)) or seen[-1]
    try:
        got = run_calls(engine, {"a": (prompt, [frames[:1], frames[1:4], frames[4:5], frames[5:]])})
    finally:
        del ours.compute_logits
    assert got["a"] == want
    frame_logits = [x[-1] for x in seen[1:]]  # after the prime's
    for ours_row, ref_row in zip(frame_logits, ref_logits, strict=True):
        assert ((ours_row - ref_row).abs().max() / ref_row.abs().max()).item() < 1e-5
    engine.release("a")
    assert engine.inner.forward.states.num_used == 0 and engine.inner.pool.num_used_pages == 0


def test_calls_batched_in_one_plan_equal_each_alone(models):
    _, ours = models
    g = torch.Generator().manual_seed(2)
    a = (([9, 4], [torch.randn(2, 32, generator=g), torch.randn(3, 32, generator=g)]))
    b = (([11], [torch.randn(1, 32, generator=g), torch.randn(4, 32, generator=g), torch.randn(1, 32, generator=g)]))
    together = run_calls(nano(ours), {"a": a, "b": b})
    assert together["a"] == run_calls(nano(ours), {"a": a})["a"]
    assert together["b"] == run_calls(nano(ours), {"b": b})["b"]
    assert len(together["a"]) == 5 and len(together["b"]) == 6
