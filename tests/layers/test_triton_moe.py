"""The grouped-GEMM MoE kernels (``triton_fused_moe``) against ``fused_moe``'s expert loop:
one and a few tokens (decode) and more tokens than a block, top-2 and top-3 with a token sent
to one expert twice, idle experts, fp32 and bf16, shapes that are not multiples of the blocks;
the pair sort's layout; ``MoEExperts`` and the tiny Qwen3-Omni thinker with
``use_fused_kernels(True)`` against eager.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (see
tests/support/triton_interpreter.py; ``test_kernels_in_a_fresh_interpreter`` reruns the file
in a process of its own when Triton was imported first). On a GPU the same tests run compiled,
plus ``test_gpu_block_configs`` (defined there only), which takes every entry of ``moe_config``'s table.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, REASON, kernels_runnable, rerun_in_fresh_interpreter  # isort: skip
from mstar.layers import triton_moe  # noqa: E402
from mstar.layers.moe import MoEExperts, SparseMoE, fused_moe, use_moe_kernel  # noqa: E402
from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.layers.triton_moe import moe_config, sort_pairs, sort_pairs_fast, triton_fused_moe  # noqa: E402
from mstar.model.qwen3_omni import Qwen3OmniTextConfig, Qwen3OmniThinkerForCausalLM  # noqa: E402
from tests.support.pages import Pages  # noqa: E402

RUNNABLE = kernels_runnable(triton_moe)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)

EXPERTS, HIDDEN, INNER = 8, 64, 32
# bf16: the interpreter rounds float32 to bfloat16 by truncation (a compiled kernel rounds to
# nearest), so its products and activations carry up to twice a bf16 rounding step
BF16_TOL = 3e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def problem(tokens: int, top_k: int, hidden: int = HIDDEN, inner: int = INNER, experts: int = EXPERTS,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    """fp32 ``(x, ids, weights, w_gate_up, w_down)`` on DEVICE; the last two experts get no
    token, and with ``top_k`` 3 the first token takes its first expert twice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts - 2, generator=g)[:top_k] for _ in range(tokens)])
    if top_k >= 3:
        ids[0, 2] = ids[0, 0]
    weights = torch.rand(tokens, top_k, generator=g)
    w_gate_up = torch.randn(experts, 2 * inner, hidden, generator=g) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, inner, generator=g) / inner ** 0.5
    return tuple(t.to(DEVICE) for t in (x, ids, weights, w_gate_up, w_down))


def test_sort_pairs_layout() -> None:
    """Each expert's pairs in pair order, padded to whole blocks, runs in expert order; idle
    experts take no block; the blocks past the runs belong to no expert."""
    ids = torch.tensor([[0, 0, 3], [3, 1, 0]])
    sorted_pairs, block_expert = sort_pairs(ids, num_experts=5, block_m=4)
    pad = 6  # T * k; room for 5 blocks: 6 pairs + 5 experts' padding of at most 3, in blocks of 4
    assert sorted_pairs.tolist() == [0, 1, 5, pad, 4, pad, pad, pad, 2, 3, pad, pad] + [pad] * 8
    assert block_expert.tolist() == [0, 1, 3, 5, 5]


@runnable
@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 8, 128, 16), (2, 3, 5, 4), (37, 3, 8, 16),
                                                             (60, 8, 128, 64), (513, 8, 128, 64)])
def test_sort_kernel_matches_torch(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    """The one-launch sort (up to 4096 pairs; 513 x 8 is past it, so torch's) lays the pairs
    out exactly as torch's."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[0, -1] = ids[0, 0]
    want = sort_pairs(ids, experts, block_m)
    got = sort_pairs_fast(ids.to(DEVICE), experts, block_m)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_kernels_match_the_expert_loop(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    x, ids, weights, w_gate_up, w_down = problem(tokens, top_k)
    args = (x.to(dtype), ids, weights.to(dtype), w_gate_up.to(dtype), w_down.to(dtype))
    got = triton_fused_moe(*args)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(got, fused_moe(*args)) < 1e-5
    else:  # against fp32 on the same bf16 inputs, as the bf16 loop is held (it rounds more often)
        want = fused_moe(*(t if t is ids else t.float() for t in args))
        assert rel_err(fused_moe(*args), want) < BF16_TOL
        assert rel_err(got, want) < BF16_TOL


@runnable
def test_shapes_off_the_block_grid() -> None:
    """H and I not multiples of the K step or the column blocks (masked loads and stores), a
    non-contiguous ``x``, and no tokens at all."""
    x, ids, weights, w_gate_up, w_down = problem(9, 2, hidden=40, inner=24, experts=5)
    x = torch.cat([x, x], dim=1)[:, ::2]
    assert rel_err(triton_fused_moe(x, ids, weights, w_gate_up, w_down),
                   fused_moe(x, ids, weights, w_gate_up, w_down)) < 1e-5
    empty = triton_fused_moe(x[:0], ids[:0], weights[:0], w_gate_up, w_down)
    assert empty.shape == (0, 40)


@runnable
def test_moe_experts_kernel_switch() -> None:
    moe = SparseMoE(HIDDEN, INNER, EXPERTS, top_k=3, normalize=True).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(2, 7, HIDDEN, device=DEVICE)
    with torch.no_grad():
        eager = moe(x)
        assert use_moe_kernel(moe, "triton") == 1 and moe.experts.kernel == "triton"
        fused = moe(x)
        use_moe_kernel(moe, "grouped_mm")
        grouped = moe(x) if DEVICE.type == "cpu" else eager  # CUDA's _grouped_mm may take bf16 only
    assert rel_err(fused, eager) < 1e-5 and rel_err(grouped, eager) < 1e-5
    assert moe.experts.kernel == "grouped_mm"
    with pytest.raises(ValueError, match="MoE kernel 'cutlass'"):
        use_moe_kernel(moe, "cutlass")
    assert MoEExperts.kernel == "loop"  # the class default is untouched


TINY_THINKER = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=INNER,
                    num_experts=EXPERTS, num_experts_per_tok=3, mlp_only_layers=[1], rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                     "interleaved": True, "mrope_interleaved": True})


@runnable
@torch.no_grad()
def test_thinker_fused_kernels_equal_eager() -> None:
    """Logits of two prompts' prefill, then two decode steps of both, eager and with the MoE
    kernels, each on its own cache."""
    torch.manual_seed(0)
    model = Qwen3OmniThinkerForCausalLM(Qwen3OmniTextConfig.from_hf_dict(TINY_THINKER)).to(DEVICE).eval()
    for name, p in model.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    config = model.config
    steps = [[("a", 5), ("b", 3)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)]]
    tokens = torch.randint(0, 64, (sum(n for step in steps for _, n in step),))
    logits = {}
    for fused in (False, True):
        model.use_fused_kernels(fused)
        assert model.fused_kernels == fused
        caches = allocate_kv_cache(config.num_hidden_layers, 8, 4, config.num_key_value_heads, config.head_dim,
                                   torch.float32, DEVICE)
        pages, out, used = Pages(8, 4, seed=1), [], 0
        for step in steps:
            meta = pages.step(step)
            meta = replace(meta, **{f: getattr(meta, f).to(DEVICE) for f in
                                    ("positions", "slot_mapping", "query_start_loc", "seq_lens", "page_table")})
            count = sum(n for _, n in step)
            out.append(model.compute_logits(model(tokens[used:used + count].to(DEVICE), meta, caches)))
            used += count
        logits[fused] = torch.cat(out)
    assert rel_err(logits[True], logits[False]) < 1e-5


if DEVICE.type == "cuda":  # defined only there: the interpreter rerun allows no skipped test

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("tokens", [1, 24, 200, 700, 3000])
    def test_gpu_block_configs(tokens: int, dtype: torch.dtype) -> None:
        """Every entry of ``moe_config``'s table (rows per expert from 0.25 to 750) at a
        model-like width, compiled."""
        x, ids, weights, w_gate_up, w_down = problem(tokens, 4, hidden=512, inner=192, experts=16, seed=tokens)
        assert moe_config(tokens * 4, 16, 2).block_m in (16, 32, 64, 128)
        args = (x.to(dtype), ids, weights.to(dtype), w_gate_up.to(dtype), w_down.to(dtype))
        want = fused_moe(*(t if t is ids else t.float() for t in args))
        assert rel_err(triton_fused_moe(*args), want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_kernels_in_a_fresh_interpreter():
    if RUNNABLE or DEVICE.type == "cuda":
        pytest.skip("the kernels ran in this process")
    rerun_in_fresh_interpreter(__file__)
