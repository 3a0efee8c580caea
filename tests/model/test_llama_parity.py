"""Parity of the paged Llama decoder (and its layers) against Hugging Face transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers.models.llama import modeling_llama as hf_llama

from mstar.layers.attention import paged_attention
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.layers.rotary import RotaryEmbedding
from mstar.model.llama import LlamaConfig, LlamaForCausalLM
from mstar.model.llama.modeling import kv_cache_shape
from mstar.model.weights import iter_safetensors, load_weights

TOL = 1e-5
PAGE_SIZE = 4
NUM_PAGES = 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = rel_err(ours, ref)
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


class Pages:
    """Test-only page allocator: shuffled free pages, one page list per sequence."""

    def __init__(self, num_pages: int = NUM_PAGES, page_size: int = PAGE_SIZE, seed: int = 0):
        self.page_size = page_size
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[Any, list[int]] = {}
        self.lens: dict[Any, int] = {}

    def step(self, chunks: list[tuple[Any, int]]) -> PagedAttentionMetadata:
        """Metadata for a step appending ``n`` new tokens to each ``(seq, n)`` in order."""
        positions, slots, starts, seq_lens = [], [], [0], []
        for seq, n in chunks:
            pages = self.pages.setdefault(seq, [])
            old = self.lens.get(seq, 0)
            new = self.lens[seq] = old + n
            while len(pages) * self.page_size < new:
                pages.append(self.free.pop())
            for p in range(old, new):
                positions.append(p)
                slots.append(pages[p // self.page_size] * self.page_size + p % self.page_size)
            starts.append(starts[-1] + n)
            seq_lens.append(new)
        width = max(len(self.pages[seq]) for seq, _ in chunks)
        table = [self.pages[seq] + [0] * (width - len(self.pages[seq])) for seq, _ in chunks]
        return PagedAttentionMetadata(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            page_table=torch.tensor(table),
            page_size=self.page_size,
        )


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, eps=1e-5), hf_llama.LlamaRMSNorm(64, eps=1e-5)
    weight = 1 + 0.1 * torch.randn(64)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (3 * torch.randn(7, 64)).to(dtype)
    out, expected = ours(x), ref(x)
    assert out.dtype == expected.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


ROPE_VARIANTS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rotary_matches_hf(variant: str) -> None:
    torch.manual_seed(0)
    head_dim, theta, scaling = 32, 500000.0, ROPE_VARIANTS[variant]
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    hf_config = HFLlamaConfig(
        hidden_size=128, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope_parameters
    )
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 1000, 4097, 31, 2])
    q, k = torch.randn(len(positions), 4, head_dim), torch.randn(len(positions), 2, head_dim)

    cos, sin = hf_llama.LlamaRotaryEmbedding(hf_config)(q, positions[None])
    q_ref, k_ref = hf_llama.apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    q_out, k_out = RotaryEmbedding(head_dim, theta, scaling)(positions, q, k)
    check(f"rotary[{variant}] q", q_out, q_ref[0], tol=1e-6)
    check(f"rotary[{variant}] k", k_out, k_ref[0], tol=1e-6)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal GQA attention over one whole sequence: ``[L, H, D]`` in and out."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def test_paged_attention_matches_dense() -> None:
    torch.manual_seed(0)
    hq, hkv, d, scale = 4, 2, 8, 0.3
    lengths = {"a": 13, "b": 6, "c": 9}
    qkv = {s: [torch.randn(n, h, d) for h in (hq, hkv, hkv)] for s, n in lengths.items()}
    expected = {s: dense_causal(*t, scale) for s, t in qkv.items()}
    done = dict.fromkeys(lengths, 0)
    pages = Pages(seed=1)
    cache = allocate_kv_cache(1, NUM_PAGES, PAGE_SIZE, hkv, d, torch.float32, "cpu")[0]

    # Prefill (a chunk of a), decodes, a chunked continuation mixed with decodes, then c joins.
    steps = [
        [("a", 5), ("b", 4)],
        [("a", 1), ("b", 1)],
        [("b", 1), ("a", 6)],
        [("a", 1), ("c", 9), ("b", 0)],
    ]
    for i, chunks in enumerate(steps):
        meta = pages.step(chunks)
        rows = [(s, slice(done[s], done[s] + n)) for s, n in chunks]
        q, k, v = (torch.cat([qkv[s][j][r] for s, r in rows]) for j in range(3))
        out = paged_attention(q, k, v, cache, meta, scale)
        check(f"paged_attention step {i}", out, torch.cat([expected[s][r] for s, r in rows]))
        for s, n in chunks:
            done[s] += n

    flat = cache.view(2, -1, hkv, d)
    for s, n in lengths.items():
        slots = [pages.pages[s][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(n)]
        torch.testing.assert_close(flat[0, slots], qkv[s][1], rtol=0, atol=0)
        torch.testing.assert_close(flat[1, slots], qkv[s][2], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Whole model
# ---------------------------------------------------------------------------------------------

MODEL_VARIANTS: dict[str, dict[str, Any]] = {
    "tied": {"tie_word_embeddings": True},
    "untied": {"tie_word_embeddings": False},
    "llama3": {  # short original context so high, medium and low frequencies all occur
        "tie_word_embeddings": True,
        "rope_parameters": {
            **ROPE_VARIANTS["llama3"],  # type: ignore[dict-item]
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
    },
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
    "bias": {"attention_bias": True, "mlp_bias": True, "head_dim": 24, "num_key_value_heads": 1},
}


def build_pair(variant: str) -> tuple[HFLlamaForCausalLM, LlamaForCausalLM]:
    """A randomly initialised tiny HF model and ours with its weights loaded strictly."""
    kwargs: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    kwargs.update(MODEL_VARIANTS[variant])
    hf_config = HFLlamaConfig(**kwargs)
    torch.manual_seed(0)
    hf = HFLlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # larger-than-default weights so attention is far from uniform
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))

    config = LlamaConfig.from_hf_dict(hf_config.to_dict())
    ours = LlamaForCausalLM(config).eval()
    state = hf.state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    load_weights(ours, state.items())  # unfused HF keys into the fused q/k/v and gate/up, strictly
    return hf, ours


@torch.no_grad()
def hf_logits(hf: HFLlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """HF logits of every position of a whole sequence, without any cache."""
    return hf(torch.tensor([tokens]), use_cache=False).logits[0]


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
@torch.no_grad()
def test_model_parity(variant: str) -> None:
    hf, ours = build_pair(variant)
    layers, kv_heads, head_dim = kv_cache_shape(ours.config)
    caches = allocate_kv_cache(
        layers, NUM_PAGES, PAGE_SIZE, kv_heads, head_dim, torch.float32, "cpu"
    )
    pages = Pages(seed=2)
    gen = torch.Generator().manual_seed(3)
    seqs: dict[str, list[int]] = {}
    worst = 0.0

    def run(name: str, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
        """One paged step; checks every row of logits against HF on the whole sequence."""
        nonlocal worst
        meta = pages.step([(s, len(toks)) for s, toks in chunks])
        ids = torch.tensor([t for _, toks in chunks for t in toks])
        logits = ours.compute_logits(ours(ids, meta, caches))
        expected = []
        for s, toks in chunks:
            seqs.setdefault(s, []).extend(toks)
            expected.append(hf_logits(hf, seqs[s])[len(seqs[s]) - len(toks) :])
        check(f"{variant} {name}", logits, torch.cat(expected))
        worst = max(worst, rel_err(logits, torch.cat(expected)))
        return logits

    def rand(n: int) -> list[int]:
        return torch.randint(0, 128, (n,), generator=gen).tolist()

    # Batched prefill of three sequences of different lengths.
    run("prefill", [("a", rand(7)), ("b", rand(13)), ("c", rand(3))])
    # Decode steps; small shuffled pages make every sequence span non-contiguous pages.
    for i in range(8):
        run(f"decode {i}", [(s, rand(1)) for s in ("a", "b", "c")])
    # A new sequence's prefill mixed with decodes of the others.
    run("mixed", [("a", rand(1)), ("d", rand(10)), ("b", rand(1)), ("c", rand(1))])
    # Chunked prefill: two chunks (the second mixed with a decode) vs one-shot.
    prompt = rand(14)
    first = run("chunk 1", [("e", prompt[:6])])
    second = run("chunk 2", [("b", rand(1)), ("e", prompt[6:])])[1:]
    one_shot = run("one-shot", [("f", prompt)])
    check(f"{variant} chunked vs one-shot", torch.cat([first, second]), one_shot)
    print(f"[parity] {variant}: worst logits rel err {worst:.2e}")


def test_parameter_names_match_checkpoint(tmp_path: Path) -> None:
    for variant, tied in (("tied", True), ("untied", False)):
        hf, ours = build_pair(variant)
        hf.save_pretrained(tmp_path / variant)
        saved = load_file(str(tmp_path / variant / "model.safetensors"))
        assert ("lm_head.weight" in saved) is not tied
        # Every parameter but the fused projections is named like its checkpoint key; the
        # fused ones are filled, segment by segment, from the unfused keys.
        fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
        expected = set(saved)
        for i in range(ours.config.num_hidden_layers):
            for name, parts in fused.items():
                parent = f"model.layers.{i}.{name.split('.')[0]}"
                expected -= {f"{parent}.{part}.weight" for part in parts}
                expected.add(f"model.layers.{i}.{name}.weight")
        assert set(dict(ours.named_parameters())) == expected
        fresh = LlamaForCausalLM(ours.config)
        load_weights(fresh, iter_safetensors(tmp_path / variant))  # strict: coverage both ways
        for i in range(ours.config.num_hidden_layers):
            layer = fresh.model.layers[i]
            for fused_layer, parent, parts in ((layer.self_attn.qkv_proj, "self_attn", fused["self_attn.qkv_proj"]),
                                               (layer.mlp.gate_up_proj, "mlp", fused["mlp.gate_up_proj"])):
                full = torch.cat([saved[f"model.layers.{i}.{parent}.{part}.weight"] for part in parts])
                assert torch.equal(fused_layer.weight, full)
        with open(tmp_path / variant / "config.json") as f:
            assert LlamaConfig.from_hf_dict(json.load(f)) == ours.config


def test_config_round_trip() -> None:
    legacy = {
        "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [1, 2],
        "head_dim": None, "some_unknown_key": 1,
    }
    config = LlamaConfig.from_hf_dict(legacy)
    assert config.head_dim == 8 and config.rope_theta == 5e5
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_id == [1, 2]
    assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == config
    hf = HFLlamaConfig(**config.to_hf_dict())
    assert hf.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == config
