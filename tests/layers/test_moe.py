"""The fused MoE layer against transformers' Qwen3-Omni thinker sparse block (its expert loop),
fp32 on the CPU: routing, experts hit twice or never, and loading the per-expert checkpoint
names into the stacked weights with coverage both ways; the talker's block with its gated
shared expert."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe")
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeTalkerTextSparseMoeBlock,
    Qwen3OmniMoeThinkerTextSparseMoeBlock,
)

from mstar.layers.moe import SparseMoE, fused_moe, route_topk  # noqa: E402
from mstar.model.weights import WeightLoadError, load_weights  # noqa: E402

HIDDEN, INNER, EXPERTS, TOP_K = 16, 12, 8, 3


def reference_block(normalize: bool, seed: int = 0) -> Qwen3OmniMoeThinkerTextSparseMoeBlock:
    config = Qwen3OmniMoeTextConfig(hidden_size=HIDDEN, moe_intermediate_size=INNER, num_experts=EXPERTS,
                                    num_experts_per_tok=TOP_K, norm_topk_prob=normalize, hidden_act="silu")
    block = Qwen3OmniMoeThinkerTextSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def per_expert_checkpoint(block: Qwen3OmniMoeThinkerTextSparseMoeBlock) -> list[tuple[str, torch.Tensor]]:
    """The block's weights under the released per-expert names."""
    tensors = [("gate.weight", block.gate.weight.detach())]
    for i in range(EXPERTS):
        gate, up = block.experts.gate_up_proj[i].detach().chunk(2, dim=0)
        tensors += [(f"experts.{i}.gate_proj.weight", gate), (f"experts.{i}.up_proj.weight", up),
                    (f"experts.{i}.down_proj.weight", block.experts.down_proj[i].detach())]
    return tensors


def ours_from(block: Qwen3OmniMoeThinkerTextSparseMoeBlock, normalize: bool) -> SparseMoE:
    moe = SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, normalize)
    load_weights(moe, per_expert_checkpoint(block))
    return moe


@pytest.mark.parametrize("normalize", [True, False])
def test_sparse_block_matches_transformers(normalize: bool) -> None:
    block = reference_block(normalize)
    moe = ours_from(block, normalize)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_matches_transformers_router() -> None:
    block = reference_block(normalize=True)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, want_weights, want_ids = block.gate(x)
        ids, weights = route_topk(logits, TOP_K, normalize=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)


@pytest.mark.parametrize("grouped_mm", [False, True])
def test_repeated_and_idle_experts(grouped_mm: bool) -> None:
    """A token sent to one expert in two of its slots gets both contributions; experts 4..7
    get no token at all (also with ``torch._grouped_mm``)."""
    block = reference_block(normalize=False)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0, 0, 1], [2, 1, 2], [3, 3, 3], [1, 0, 2], [0, 3, 0]])
    weights = torch.rand(5, TOP_K, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block.experts(x, ids, weights)
        got = fused_moe(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj, grouped_mm=grouped_mm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_single_token_decode_shape() -> None:
    block = reference_block(normalize=True)
    moe = ours_from(block, normalize=True)
    x = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-5)


def test_loading_names_missing_and_unexpected_experts() -> None:
    block = reference_block(normalize=True)
    tensors = [(n, t) for n, t in per_expert_checkpoint(block) if n != "experts.5.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"experts\.5\.up_proj\.weight"):
        load_weights(SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, True), tensors)
    extra = per_expert_checkpoint(block) + [("experts.8.down_proj.weight", torch.zeros(HIDDEN, INNER))]
    with pytest.raises(WeightLoadError, match=r"experts\.8\.down_proj\.weight"):
        load_weights(SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, True), extra)
    wrong = [(n, t.T.contiguous() if n == "experts.2.down_proj.weight" else t)
             for n, t in per_expert_checkpoint(block)]
    with pytest.raises(WeightLoadError, match="segment"):
        load_weights(SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, True), wrong)


SHARED = 20


def reference_shared_block(seed: int = 6) -> Qwen3OmniMoeTalkerTextSparseMoeBlock:
    config = Qwen3OmniMoeTalkerTextConfig(hidden_size=HIDDEN, moe_intermediate_size=INNER, num_experts=EXPERTS,
                                          num_experts_per_tok=TOP_K, norm_topk_prob=True, hidden_act="silu",
                                          shared_expert_intermediate_size=SHARED)
    block = Qwen3OmniMoeTalkerTextSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def shared_checkpoint(block: Qwen3OmniMoeTalkerTextSparseMoeBlock) -> list[tuple[str, torch.Tensor]]:
    """The talker block under the released names: the routed experts apart, then the shared one."""
    tensors = per_expert_checkpoint(block)
    tensors += [(f"shared_expert.{n}", t.detach()) for n, t in block.shared_expert.named_parameters()]
    return tensors + [("shared_expert_gate.weight", block.shared_expert_gate.weight.detach())]


def test_shared_expert_matches_talker_block() -> None:
    """The talker's block: routed experts plus ``sigmoid(gate(x)) * shared(x)``."""
    block = reference_shared_block()
    moe = SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, True, shared_inner=SHARED)
    load_weights(moe, shared_checkpoint(block))
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-5)
    assert not any("shared" in n for n in SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, True).state_dict())


def test_shared_expert_coverage_both_ways() -> None:
    block = reference_shared_block()
    lacking = [(n, t) for n, t in shared_checkpoint(block) if n != "shared_expert_gate.weight"]
    with pytest.raises(WeightLoadError, match="shared_expert_gate"):
        load_weights(SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, True, shared_inner=SHARED), lacking)
    with pytest.raises(WeightLoadError, match=r"shared_expert\.up_proj"):  # a block built without one
        load_weights(SparseMoE(HIDDEN, INNER, EXPERTS, TOP_K, True), shared_checkpoint(block))
