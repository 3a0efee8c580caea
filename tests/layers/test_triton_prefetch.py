"""L2 prefetch from a side stream (``mstar.layers.triton_prefetch``): the plan's parsing, a
no-op on the CPU, and on a GPU the Llama decode path's logits bit for bit equal with and
without it, eagerly and from a captured CUDA graph (a prefetch changes no value)."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.triton_prefetch import L2Prefetch, PrefetchPlan, l2_prefetch
from mstar.model.llama import modeling
from mstar.model.llama.modeling import GemvRule
from tests.support.markers import needs_cuda


def test_plan_parses_and_refuses_unknown_keys() -> None:
    assert PrefetchPlan.parse("") == PrefetchPlan() and not PrefetchPlan.parse("off").active
    plan = PrefetchPlan.parse("o=1, gate_up=0.25,max_rows=16")
    assert plan == PrefetchPlan(o=1.0, gate_up=0.25, max_rows=16) and plan.active
    assert not PrefetchPlan(o=1.0).active  # no rows: off
    with pytest.raises(ValueError, match="'down'"):
        PrefetchPlan.parse("down=1")


def test_cpu_tensors_are_left_alone() -> None:
    weight = torch.ones(8, 64)
    l2_prefetch(weight, 1.0)
    prefetch = L2Prefetch()
    prefetch.fetch(weight, 1.0)
    prefetch.join()
    assert torch.equal(weight, torch.ones(8, 64))


@needs_cuda(triton=True)
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_prefetch_gives_the_same_logits(rows: int) -> None:
    from test_cuda_graphs import eager_and_graphed_step
    from test_cuda_graphs import tiny_llama as gpu_llama

    device = torch.device("cuda")
    model = gpu_llama(device, torch.bfloat16)
    model.use_fused_kernels()
    lens = {f"s{i}": 3 + i for i in range(rows)}
    prompt = torch.randint(0, 512, (sum(lens.values()),), device=device)
    tokens = torch.randint(0, 512, (rows,), device=device)
    results = {}
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling, "DECODE_GEMV", GemvRule(qkv=64, o=64, gate_up=64, down=64, norm_prologue=0))
        for plan in ("off", "qkv=0.5,o=1,gate_up=0.25,max_rows=64"):
            patch.setattr(modeling, "L2_PREFETCH", PrefetchPlan.parse(plan))
            results[plan] = eager_and_graphed_step(model, lens, prompt, tokens, device)
    (off_eager, off_graphed), (on_eager, on_graphed) = results.values()
    assert torch.equal(on_eager, off_eager) and torch.equal(on_graphed, off_graphed)
