"""Parity of the paged GLM-5.2 decoder (MLA over a latent cache, the DSA indexer, the MoE with
a shared expert) against transformers' ``GlmMoeDsaForCausalLM``, float32 on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.glm52 import Glm52Config, Glm52ForCausalLM
from mstar.model.glm52.attention import Glm52Indexer
from mstar.model.weights import load_weights
from tests.support.glm52 import released_tensors, tiny_reference
from tests.support.pages import Pages

TOL = 1e-5
PAGE_SIZE = 4


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"
    return err


def build_pair(**overrides) -> tuple[torch.nn.Module, Glm52ForCausalLM]:
    ref = tiny_reference(**overrides)
    ours = Glm52ForCausalLM(Glm52Config.from_dict(ref.config.to_dict())).eval()
    load_weights(ours, released_tensors(ref).items())
    return ref, ours


def reference_logits(ref, prompt: list[int], decoded: list[int]) -> list[torch.Tensor]:
    """The prompt's logits ``[P, V]``, then one ``[1, V]`` per decoded token, through the
    reference's own cache."""
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        out = [ref(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]]
        for token in decoded:
            out.append(ref(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0])
    return out


def test_batched_prefill_and_decode_match_reference() -> None:
    """Three requests batched (prompts of 5, 9 and 29 tokens; the indexer keeps 6 keys, so the
    longer two attend to a strict subset), one prefill step, then six decode steps of all three
    rows; the middle layer shares the first layer's choice of keys. A fourth request (70 tokens)
    is prefilled in the third decode step, beside the decoding rows, and decodes after it in a
    key block of its own (two decode groups a step)."""
    ref, ours = build_pair()
    gen = torch.Generator().manual_seed(1)
    vocab = ref.config.vocab_size
    prompts = {name: torch.randint(2, vocab, (n,), generator=gen).tolist() for name, n in
               (("a", 5), ("b", 9), ("c", 29), ("d", 70))}
    steps, joins = 6, 2
    decoded = {name: torch.randint(2, vocab, (steps,), generator=gen).tolist() for name in prompts}
    expected = {name: reference_logits(ref, prompts[name], decoded[name]) for name in prompts}

    pages = Pages(num_pages=60, page_size=PAGE_SIZE)
    layers, heads, width, planes = ours.cache_shape()
    caches = allocate_kv_cache(layers, 60, PAGE_SIZE, heads, width, torch.float32, "cpu", planes=planes)
    dropped = []
    original_select = Glm52Indexer.select

    def spy(self, q, weights, keys, visible):  # records whether the top-k left out visible keys
        chosen = original_select(self, q, weights, keys, visible)
        dropped.append(bool((visible & ~chosen).any()))
        return chosen

    def run(chunks: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        meta = pages.step([(name, len(ids)) for name, ids in chunks])
        logits = ours.compute_logits(ours(torch.tensor([t for _, ids in chunks for t in ids]), meta, caches))
        starts = meta.query_starts
        return {name: logits[starts[b]:starts[b + 1]] for b, (name, _) in enumerate(chunks)}

    Glm52Indexer.select = spy
    try:
        with torch.no_grad():
            first = ["a", "b", "c"]
            for name, got in run([(name, prompts[name]) for name in first]).items():
                check(f"prefill {name}", got, expected[name][0])
            done = {name: 0 for name in first}
            for step in range(steps + joins + 1):
                chunks = [(name, [decoded[name][n]]) for name, n in done.items() if n < steps]
                if step == joins:
                    chunks.append(("d", prompts["d"]))
                if not chunks:
                    break
                for name, got in run(chunks).items():
                    if name == "d" and name not in done:
                        check("prefill d (mixed step)", got, expected["d"][0])
                        done["d"] = 0
                        continue
                    check(f"decode {done[name]} {name}", got, expected[name][done[name] + 1])
                    done[name] += 1
            assert done == {name: steps for name in prompts}
    finally:
        Glm52Indexer.select = original_select
    assert any(dropped), "the indexer never left a visible key out: the test does not exercise DSA"


def test_chunked_prefill_matches_reference() -> None:
    """A 21-token prompt in chunks of 8, 8 and 5 (queries over cached and new keys at once)."""
    ref, ours = build_pair(seed=3)
    prompt = torch.randint(2, ref.config.vocab_size, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = reference_logits(ref, prompt, [])[0]
    pages = Pages(num_pages=16, page_size=PAGE_SIZE)
    layers, heads, width, planes = ours.cache_shape()
    caches = allocate_kv_cache(layers, 16, PAGE_SIZE, heads, width, torch.float32, "cpu", planes=planes)
    got = []
    with torch.no_grad():
        for s, e in ((0, 8), (8, 16), (16, 21)):
            meta = pages.step([("x", e - s)])
            got.append(ours.compute_logits(ours(torch.tensor(prompt[s:e]), meta, caches)))
    check("chunked prefill", torch.cat(got), expected)


def test_router_matches_reference() -> None:
    """Group-limited top-k with the score-correction bias and the routed scaling factor."""
    ref, ours = build_pair(seed=5)
    x = torch.randn(40, ref.config.hidden_size, generator=torch.Generator().manual_seed(6))
    _, ref_weights, ref_ids = ref.model.layers[1].mlp.gate(x)
    ids, weights = ours.model.layers[1].mlp.gate(x)
    order_ref, order = ref_ids.sort(-1), ids.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    check("router weights", weights.gather(1, order.indices), ref_weights.gather(1, order_ref.indices))


def test_config_reads_release_fields() -> None:
    """The released config's pattern keys (``index_topk_freq``, ``first_k_dense_replace``), read
    as transformers reads them."""
    from transformers import GlmMoeDsaConfig

    raw = {"num_hidden_layers": 6, "first_k_dense_replace": 2, "index_topk_freq": 2, "index_skip_topk_offset": 2,
           "rope_theta": 1e6, "eos_token_id": [1, 2]}
    config = Glm52Config.from_dict(raw)
    hf = GlmMoeDsaConfig(**raw)
    assert config.mlp_layer_types == tuple(hf.mlp_layer_types) == ("dense",) * 2 + ("sparse",) * 4
    assert config.indexer_types == tuple(hf.indexer_types) == ("full", "full", "shared", "full", "shared", "full")
    assert config.rope_theta == 1e6 and config.eos_token_id == (1, 2)
    assert config.cache_width == config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim


def test_config_refuses_what_it_does_not_compute() -> None:
    for bad, match in (({"scoring_func": "softmax"}, "scoring_func"), ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'")):
        with pytest.raises(ValueError, match=match):
            Glm52Config.from_dict({"num_hidden_layers": 4, **bad})
