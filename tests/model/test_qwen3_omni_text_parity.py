"""Parity of Qwen3-Omni's thinker text decoder (MoE layers, q/k norms, interleaved MRoPE) with
transformers' thinker on a tiny random config (fp32, CPU): logits of a text-only prompt at
prefill and at decode steps of three requests batched through the paged KV cache; loading from
the released key layout with coverage both ways."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.layers.rotary import MRotaryEmbedding  # noqa: E402
from mstar.model.qwen3_omni import Qwen3OmniTextConfig, Qwen3OmniThinkerForCausalLM  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import load_thinker_text  # noqa: E402
from mstar.model.weights import WeightLoadError  # noqa: E402
from tests.support.pages import Pages  # noqa: E402
from tests.support.qwen3_omni import reference_thinker, released_keys  # noqa: E402

TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def reference():
    return reference_thinker()


@pytest.fixture(scope="module")
def ours(reference) -> Qwen3OmniThinkerForCausalLM:
    model = Qwen3OmniThinkerForCausalLM(Qwen3OmniTextConfig.from_hf_dict(reference.config.to_dict())).eval()
    load_thinker_text(model, released_keys(reference))
    return model


def test_config_from_thinker_dict(reference) -> None:
    config = Qwen3OmniTextConfig.from_hf_dict({"thinker_config": reference.config.to_dict()})
    assert (config.head_dim, config.mrope_section, config.rope_theta) == (16, [4, 2, 2], 10000.0)
    assert [config.is_sparse(i) for i in range(3)] == [True, False, True]


def test_mrope_matches_transformers(reference) -> None:
    """The interleaved sections, on positions whose three axes differ."""
    rotary = reference.model.language_model.rotary_emb
    positions = torch.tensor([[0, 3, 3, 3, 9], [0, 1, 2, 5, 9], [0, 4, 1, 2, 9]])
    x = torch.zeros(1, 5, 16)
    want_cos, want_sin = rotary(x, positions[:, None, :])
    cos, sin = MRotaryEmbedding(16, 10000.0, [4, 2, 2]).cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos, want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_text_logits_prefill_and_decode(reference, ours) -> None:
    config = ours.config
    caches = allocate_kv_cache(config.num_hidden_layers, 24, 4, config.num_key_value_heads, config.head_dim,
                               torch.float32, "cpu")
    pages = Pages(24, 4, seed=1)
    gen = torch.Generator().manual_seed(2)
    seqs: dict[str, list[int]] = {}
    worst = 0.0

    def step(chunks: list[tuple[str, list[int]]]) -> None:
        nonlocal worst
        meta = pages.step([(s, len(t)) for s, t in chunks])
        logits = ours.compute_logits(ours(torch.tensor([t for _, t in chunks for t in t]), meta, caches))
        want = []
        for s, toks in chunks:
            seqs.setdefault(s, []).extend(toks)
            full = reference(input_ids=torch.tensor([seqs[s]]), use_cache=False).logits[0]
            want.append(full[len(seqs[s]) - len(toks):])
        err = rel_err(logits, torch.cat(want))
        assert err < TOL, f"logits rel err {err:.2e}"
        worst = max(worst, err)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 150, (n,), generator=gen).tolist()

    step([("a", rand(7)), ("b", rand(11)), ("c", rand(3))])
    for _ in range(3):
        step([(s, rand(1)) for s in ("a", "b", "c")])
    step([("a", rand(1)), ("d", rand(5)), ("b", rand(1))])
    print(f"[parity] qwen3-omni thinker text: worst logits rel err {worst:.2e}")


def test_loading_coverage_both_ways(reference) -> None:
    config = Qwen3OmniTextConfig.from_hf_dict(reference.config.to_dict())
    keys = released_keys(reference)
    lacking = [(n, t) for n, t in keys if n != "thinker.model.layers.2.mlp.experts.6.down_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"layers\.2\.mlp\.experts\.6\.down_proj"):
        load_thinker_text(Qwen3OmniThinkerForCausalLM(config), lacking)
    extra = keys + [("thinker.model.layers.0.mlp.shared_expert.weight", torch.zeros(1))]
    with pytest.raises(WeightLoadError, match="shared_expert"):
        load_thinker_text(Qwen3OmniThinkerForCausalLM(config), extra)
    # the other components' keys are skipped on purpose
    load_thinker_text(Qwen3OmniThinkerForCausalLM(config), keys + [("talker.model.norm.weight", torch.ones(4))])
