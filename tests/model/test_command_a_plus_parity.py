"""Command A+ text decoder against transformers' ``Cohere2MoeForCausalLM`` (fp32, CPU, tiny
random configs): logits at a batched prefill of three requests and at every decode step, one
request running far past the sliding window, over the paged cache; and the sliding-window
attention of the paged layer against a dense masked reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

from mstar.layers.attention import paged_attention
from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.command_a_plus import CommandAPlusConfig, CommandAPlusForCausalLM
from mstar.model.weights import iter_safetensors, load_weights
from tests.support.pages import Pages

TOL = 1e-5
PAGE_SIZE = 4
NUM_PAGES = 96
WINDOW = 8

VARIANTS: dict[str, dict[str, Any]] = {
    # Command A+'s shape: every layer sparse, three sliding layers per global one, LayerNorm
    "layernorm": {},
    # a dense prefix (first_k_dense_replace) with RoPE on its global layer, RMSNorm, sigmoid
    # routing and a summed shared expert: the config's other branches
    "dense_prefix": dict(first_k_dense_replace=1, prefix_dense_intermediate_size=48, rms_norm_eps=1e-5,
                         expert_selection_fn="sigmoid", shared_expert_combination_strategy="sum"),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> float:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = rel_err(ours, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"
    return err


def hf_config(**overrides: Any) -> Cohere2MoeConfig:
    kwargs: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3, num_shared_experts=1,
        sliding_window=WINDOW, max_position_embeddings=256, logit_scale=0.25, eos_token_id=2, bos_token_id=1,
        attn_implementation="eager")
    kwargs.update(overrides)
    return Cohere2MoeConfig(**kwargs)


def build_pair(tmp_path: Path, **overrides: Any) -> tuple[Cohere2MoeForCausalLM, CommandAPlusForCausalLM]:
    """A tiny random HF model, saved in the released key layout (per-expert tensors, tied
    embeddings), and ours loaded from those files strictly."""
    config = hf_config(**overrides)
    torch.manual_seed(0)
    hf = Cohere2MoeForCausalLM(config).eval()
    with torch.no_grad():  # larger-than-default weights: attention far from uniform, routing decisive
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = CommandAPlusForCausalLM(CommandAPlusConfig.from_hf_dict(config.to_dict())).eval()
    load_weights(ours, iter_safetensors(tmp_path))
    return hf, ours


@pytest.mark.parametrize("window", [WINDOW, 70])
@torch.no_grad()
def test_sliding_window_paged_attention_matches_dense(window: int) -> None:
    """Prefill, chunked continuation and decode with a window, against a dense masked softmax
    (a window of 70 gathers a decode's keys in two key blocks)."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 8
    cache = allocate_kv_cache(1, NUM_PAGES, PAGE_SIZE, kv_heads, dim, torch.float32, "cpu")[0]
    pages = Pages(NUM_PAGES, PAGE_SIZE, seed=5)
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    steps = [[("a", 19), ("b", 5), ("c", 150)], [("a", 1), ("b", 7), ("c", 1)], [("a", 1), ("b", 1), ("c", 1)],
             [("c", 1), ("b", 1)]]
    for chunks in steps:  # prefills, a chunk, decodes: "c" decodes far past a key block
        meta = pages.step(chunks)
        total = sum(n for _, n in chunks)
        q = torch.randn(total, heads, dim, generator=gen)
        k = torch.randn(total, kv_heads, dim, generator=gen)
        v = torch.randn(total, kv_heads, dim, generator=gen)
        out = paged_attention(q, k, v, cache, meta, 0.3, window=window)
        start = 0
        for seq, n in chunks:
            old_k, old_v = history.get(seq, (k[:0], v[:0]))
            keys, values = torch.cat((old_k, k[start:start + n])), torch.cat((old_v, v[start:start + n]))
            history[seq] = keys, values
            length = keys.shape[0]
            q_pos = torch.arange(length - n, length)[:, None]
            kv_pos = torch.arange(length)[None, :]
            allowed = (kv_pos <= q_pos) & (kv_pos > q_pos - window)
            scores = torch.einsum("thd,khd->htk", q[start:start + n], keys.repeat_interleave(2, dim=1)) * 0.3
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            expected = torch.einsum("htk,khd->thd", probs, values.repeat_interleave(2, dim=1))
            check(f"window attention {seq}", out[start:start + n], expected)
            start += n


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_logits_match_transformers(variant: str, tmp_path: Path) -> None:
    """A batched prefill of three requests (one already past the window), then decode steps of
    all three, one request running to five windows; every row's logits within 1e-5."""
    hf, ours = build_pair(tmp_path, **VARIANTS[variant])
    layers, kv_heads, head_dim = ours.cache_shape()
    caches = allocate_kv_cache(layers, NUM_PAGES, PAGE_SIZE, kv_heads, head_dim, torch.float32, "cpu")
    pages = Pages(NUM_PAGES, PAGE_SIZE, seed=2)
    gen = torch.Generator().manual_seed(3)
    seqs: dict[str, list[int]] = {}
    worst = 0.0

    def rand(n: int) -> list[int]:
        return torch.randint(0, 128, (n,), generator=gen).tolist()

    def run(name: str, chunks: list[tuple[str, list[int]]]) -> None:
        nonlocal worst
        meta = pages.step([(s, len(toks)) for s, toks in chunks])
        logits = ours.compute_logits(ours(torch.tensor([t for _, toks in chunks for t in toks]), meta, caches))
        expected = []
        for s, toks in chunks:
            seqs.setdefault(s, []).extend(toks)
            full = hf(torch.tensor([seqs[s]]), use_cache=False).logits[0]
            expected.append(full[len(seqs[s]) - len(toks):])
        worst = max(worst, check(f"{variant} {name}", logits, torch.cat(expected)))

    run("prefill", [("a", rand(5)), ("long", rand(13)), ("c", rand(3))])
    for i in range(27):  # "long" ends at 40 positions: five windows
        run(f"decode {i}", [(s, rand(1)) for s in ("a", "long", "c")])
    run("mixed", [("a", rand(1)), ("d", rand(11)), ("long", rand(1))])
    print(f"[parity] command_a_plus {variant}: worst logits rel err {worst:.2e}")


def test_config_reads_the_vision_release() -> None:
    """The vision-language release nests the decoder's config under ``text_config``."""
    text = hf_config().to_dict()
    config = CommandAPlusConfig.from_hf_dict({"model_type": "cohere2_vision", "text_config": text})
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert [config.window(i) for i in range(4)] == [WINDOW, WINDOW, WINDOW, None]
    assert [config.rotary(i) for i in range(4)] == [True, True, True, False]
    assert config.rms_norm_eps is None and config.num_shared_experts == 1
