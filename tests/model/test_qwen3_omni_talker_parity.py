"""Parity of Qwen3-Omni's talker and code predictor with transformers'
``Qwen3OmniMoeTalkerForConditionalGeneration`` on a tiny random config (fp32, CPU): codebook-0
logits of batched prefills and decode steps on the paged KV cache; the code predictor's greedy
codes and step logits against its ``generate``; whole greedy talker steps (codebook 0, the
frame, the next input) against the talker's ``generate``; the projections; loading the released
``talker.`` keys with coverage both ways, and from a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import load_talker, load_talker_dir  # noqa: E402
from mstar.model.qwen3_omni.talker import Qwen3OmniTalker, Qwen3OmniTalkerConfig  # noqa: E402
from mstar.model.weights import WeightLoadError  # noqa: E402
from tests.support.pages import Pages  # noqa: E402
from tests.support.qwen3_omni import reference_talker, talker_released_keys  # noqa: E402

TOL = 1e-5
GROUPS = 5  # codebooks in the tiny config


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def reference():
    return reference_talker()


@pytest.fixture(scope="module")
def ours(reference) -> Qwen3OmniTalker:
    model = Qwen3OmniTalker.from_hf_dict({"talker_config": reference.config.to_dict()}).eval()
    load_talker(model, talker_released_keys(reference))
    return model


def new_caches(model: Qwen3OmniTalker) -> list[torch.Tensor]:
    layers, heads, head_dim = model.cache_shape()
    return allocate_kv_cache(layers, 24, 4, heads, head_dim, torch.float32, "cpu")


def test_config_from_released_dict(reference) -> None:
    d = reference.config.to_dict()
    assert "num_local_experts" in d["text_config"]  # the name transformers writes for num_experts
    config = Qwen3OmniTalkerConfig.from_hf_dict(d)
    text = config.text
    assert (text.num_experts, text.shared_expert_intermediate_size, text.mrope_section) == (8, 48, [4, 2, 2])
    assert (config.num_code_groups, config.code_predictor.vocab_size, config.codec_eos_token_id) == (GROUPS, 40, 90)
    sparse = {k: v for k, v in d["text_config"].items() if k != "norm_topk_prob"}
    assert not Qwen3OmniTalkerConfig.from_hf_dict(dict(d, text_config=sparse)).text.norm_topk_prob  # talker default
    with pytest.raises(ValueError, match="hidden_size"):
        Qwen3OmniTalkerConfig.from_hf_dict(dict(d, code_predictor_config=dict(d["code_predictor_config"],
                                                                              hidden_size=32)))
    with pytest.raises(NotImplementedError, match="mlp_only_layers"):  # the reference ignores it: refused
        Qwen3OmniTalkerConfig.from_hf_dict(dict(d, text_config=dict(d["text_config"], mlp_only_layers=[1])))


@torch.no_grad()
def test_talker_logits_prefill_and_decode(reference, ours) -> None:
    """Three requests' input embeddings: a batched prefill, two batched decode steps and a
    mixed step, on shuffled pages, against the reference's whole-sequence logits."""
    caches, pages = new_caches(ours), Pages(24, 4, seed=3)
    gen = torch.Generator().manual_seed(4)
    seqs: dict[str, torch.Tensor] = {}
    worst = 0.0

    def step(chunks: list[tuple[str, int]]) -> None:
        nonlocal worst
        meta = pages.step(chunks)
        new = {s: torch.randn(n, 64, generator=gen) for s, n in chunks}
        logits = ours.compute_logits(ours(torch.cat([new[s] for s, _ in chunks]), meta, caches))
        want = []
        for s, n in chunks:
            seqs[s] = torch.cat((seqs[s], new[s])) if s in seqs else new[s]
            want.append(reference(inputs_embeds=seqs[s][None], use_cache=False).logits[0, -n:])
        err = rel_err(logits, torch.cat(want))
        assert err < TOL, f"logits rel err {err:.2e}"
        worst = max(worst, err)

    step([("a", 6), ("b", 9), ("c", 3)])
    step([("a", 1), ("b", 1), ("c", 1)])
    step([("a", 1), ("b", 1), ("c", 1)])
    step([("b", 1), ("d", 4), ("a", 1)])
    print(f"[parity] qwen3-omni talker: worst codec logits rel err {worst:.2e}")


@torch.no_grad()
def test_code_predictor_matches_generate(reference, ours) -> None:
    """Three frames at once: the greedy codes equal the reference ``generate``'s, each inner
    step's logits (read through the sampler hook) agree, and the frame's embedding sum is the
    talker's next codec input."""
    gen = torch.Generator().manual_seed(5)
    hidden, code0 = torch.randn(3, 64, generator=gen), torch.tensor([3, 77, 40])
    seen: list[torch.Tensor] = []

    def greedy(logits: torch.Tensor, group: int) -> torch.Tensor:
        assert group == len(seen) + 1
        seen.append(logits)
        return logits.argmax(dim=-1)

    frame = ours.predict_frame(hidden, code0, sampler=greedy)
    predictor = reference.code_predictor
    prompt = torch.stack((hidden, reference.get_input_embeddings()(code0)), dim=1)
    want = predictor.generate(inputs_embeds=prompt, max_new_tokens=GROUPS - 1, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)
    assert torch.equal(frame.codes, torch.cat((code0[:, None], want.sequences), dim=1))
    worst = max(rel_err(got, ref) for got, ref in zip(seen, want.logits, strict=True))
    assert worst < TOL, f"code predictor logits rel err {worst:.2e}"
    embeds = reference.get_input_embeddings()(code0) + sum(
        predictor.get_input_embeddings()[g - 1](frame.codes[:, g]) for g in range(1, GROUPS))
    torch.testing.assert_close(frame.embeds, embeds, rtol=1e-6, atol=1e-6)
    print(f"[parity] qwen3-omni code predictor: worst step logits rel err {worst:.2e}")


@torch.no_grad()
def test_sampler_hook_sets_the_codes(ours) -> None:
    """A sampler's choice is what the frame holds and what the next inner step reads."""
    hidden, code0 = torch.randn(2, 64, generator=torch.Generator().manual_seed(6)), torch.tensor([1, 2])
    forced = ours.predict_frame(hidden, code0, sampler=lambda logits, group: torch.full((2,), group * 7))
    assert forced.codes.tolist() == [[1, 7, 14, 21, 28], [2, 7, 14, 21, 28]]
    greedy = ours.predict_frame(hidden, code0)
    assert not torch.equal(greedy.codes, forced.codes)


@torch.no_grad()
def test_greedy_talker_steps_match_generate(reference, ours) -> None:
    """Two requests (prompts of 6 and 4 embeddings) batched through four greedy talker steps:
    codebook 0 from the codec head, the frame from the code predictor, the next input = the
    frame's embedding sum + the request's next text row (``tts_pad`` after the last), as the
    reference talker's ``generate`` does for each request alone."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randn(n, 64, generator=gen) for n in (6, 4)]
    trailing = [torch.randn(n, 64, generator=gen) for n in (2, 1)]
    pad = torch.randn(64, generator=gen)
    steps = 4
    want = [reference.generate(inputs_embeds=p[None], trailing_text_hidden=t[None], tts_pad_embed=pad[None, None],
                               attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=steps,
                               do_sample=False, output_hidden_states=True, return_dict_in_generate=True,
                               output_logits=True) for p, t in zip(prompts, trailing)]

    caches, pages = new_caches(ours), Pages(24, 4, seed=8)
    names = ["a", "b"]
    meta = pages.step([(s, len(p)) for s, p in zip(names, prompts)])
    hidden = ours(torch.cat(prompts), meta, caches)[meta.query_start_loc[1:] - 1]
    frames, worst = [], 0.0
    for step in range(steps):
        logits = ours.compute_logits(hidden)
        for r, w in enumerate(want):
            worst = max(worst, rel_err(logits[r], w.logits[step][0]))
        code0 = logits.argmax(dim=-1)
        assert code0.tolist() == [w.sequences[0, step].item() for w in want]
        if step == steps - 1:
            break
        frame = ours.predict_frame(hidden, code0)
        frames.append(frame.codes)
        text = torch.stack([t[step] if step < len(t) else pad for t in trailing])
        hidden = ours(frame.embeds + text, pages.step([(s, 1) for s in names]), caches)
    assert worst < TOL, f"talker logits rel err {worst:.2e}"
    for r, w in enumerate(want):  # the reference reports frame i with step i + 1
        assert torch.stack([f[r] for f in frames]).tolist() == [h[-1][0].tolist() for h in w.hidden_states[1:]]
    print(f"[parity] qwen3-omni talker greedy steps: {steps} steps x 2 requests, codes identical, "
          f"worst logits rel err {worst:.2e}")


@torch.no_grad()
def test_projections(reference, ours) -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(ours.text_projection(x), reference.text_projection(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.hidden_projection(x), reference.hidden_projection(x), rtol=1e-6, atol=1e-6)


def test_loading_coverage_both_ways(reference) -> None:
    d = {"talker_config": reference.config.to_dict()}
    keys = talker_released_keys(reference)
    for lacking in ("talker.model.layers.1.mlp.shared_expert_gate.weight",
                    "talker.code_predictor.lm_head.3.weight", "talker.hidden_projection.linear_fc1.bias"):
        with pytest.raises(WeightLoadError, match=lacking[len("talker."):].replace(".", r"\.")):
            load_talker(Qwen3OmniTalker.from_hf_dict(d), [(n, t) for n, t in keys if n != lacking])
    for stray in ("talker.code_predictor.model.codec_embedding.4.weight",  # Q - 1 = 4 tables: 0..3
                  "talker.model.layers.0.mlp.experts.8.up_proj.weight", "talker.model.embed_tokens.weight"):
        with pytest.raises(WeightLoadError, match=stray.replace(".", r"\.")):
            load_talker(Qwen3OmniTalker.from_hf_dict(d), keys + [(stray, torch.zeros(1))])
    # the thinker's and code2wav's keys are skipped on purpose
    others = [("thinker.model.norm.weight", torch.ones(4)), ("code2wav.code_embedding.weight", torch.ones(4))]
    load_talker(Qwen3OmniTalker.from_hf_dict(d), keys + others)


def test_directory_round_trip(reference, tmp_path: Path) -> None:
    """A whole-Omni ``config.json`` and two shards that also hold other components' keys."""
    keys = dict(talker_released_keys(reference))
    keys["thinker.model.norm.weight"] = torch.ones(4)
    keys["code2wav.code_embedding.weight"] = torch.ones(4)
    keys = {n: t.contiguous() for n, t in keys.items()}
    names = sorted(keys)
    half = len(names) // 2
    save_file({n: keys[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: keys[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe",
                                                      "talker_config": reference.config.to_dict()}))
    talker = load_talker_dir(tmp_path)
    ours, theirs = talker.model.layers[1].mlp, reference.model.layers[1].mlp
    torch.testing.assert_close(ours.experts.gate_up.weight, theirs.experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.shared_expert.down_proj.weight, theirs.shared_expert.down_proj.weight,
                               rtol=0, atol=0)
    torch.testing.assert_close(talker.code_predictor.lm_head[2].weight, reference.code_predictor.lm_head[2].weight,
                               rtol=0, atol=0)
