"""Pi0.5's denoise fast path (``model_kwargs.compile``, ``mstar.model.pi05.fast``) against the
eager policy: the same tiny random weights, compiled expert and prefix blocks, chunks equal to eager at
one and two requests per forward (the second batch size retraces with a symbolic count)."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar.model.knobs import Knobs
from mstar.model.pi05.config import Pi05Config
from mstar.model.pi05.fast import compile_policy, expert_blocks, prefix_blocks
from mstar.model.pi05.knobs import Pi05Knobs
from mstar.model.pi05.modeling import Pi05Policy
from mstar.model.weights import init_dummy_weights
from tests.support.markers import needs_cuda
from tests.support.pi05 import tiny_lerobot_config


def observations(count: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(1 + b % 2, 3, 16, 16, generator=g) * 2 - 1, torch.randint(0, 90, (7 + 3 * b,), generator=g))
            for b in range(count)]


def policies(device: str, backend: str) -> tuple[Pi05Policy, Pi05Policy]:
    eager = Pi05Policy(Pi05Config.from_lerobot(tiny_lerobot_config()))
    init_dummy_weights(eager, seed=5, std=0.1)
    eager = eager.to(device).eval()
    return eager, compile_policy(copy.deepcopy(eager), backend)


def compare(eager: Pi05Policy, fast: Pi05Policy, device: str, tol: float) -> None:
    for count in (1, 2):
        obs = observations(count)
        pixels = [p.to(device) for p, _ in obs]
        ids = [i.to(device) for _, i in obs]
        noise = torch.randn(count, 5, 6, generator=torch.Generator().manual_seed(count)).to(device)
        want = eager.sample_actions(pixels, ids, noise, page_size=4)
        got = fast.sample_actions(pixels, ids, noise, page_size=4)
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= tol, (count, err)
        assert float((want - noise).abs().max()) > 0.1  # the steps moved the noise


def test_compile_knob_is_off_by_default_and_parses() -> None:
    assert issubclass(Pi05Knobs, Knobs)
    assert Pi05Knobs.parse({}).compile is False
    knobs = Pi05Knobs.parse({"compile": True, "compile_backend": "aot_eager"})
    assert knobs.compile and knobs.compile_backend == "aot_eager"


def test_blocks_are_every_expert_norm_and_mlp() -> None:
    eager, fast = policies("cpu", "eager")
    layers = eager.config.expert.num_layers
    assert len(expert_blocks(eager)) == 3 * layers + 1
    assert len(prefix_blocks(eager)) == 3 * eager.config.text.num_layers + 3 * eager.config.vision.num_layers + 2
    assert all(b._compiled_call_impl is not None for b in expert_blocks(fast) + prefix_blocks(fast))
    assert all(b._compiled_call_impl is None for b in expert_blocks(eager))  # the copy was compiled


@pytest.mark.timeout(120)
def test_compiled_expert_equals_eager_on_cpu() -> None:
    torch._dynamo.reset()
    eager, fast = policies("cpu", "inductor")
    compare(eager, fast, "cpu", 1e-5)


@needs_cuda
def test_compiled_expert_equals_eager_on_gpu() -> None:
    torch._dynamo.reset()
    eager, fast = policies("cuda", "inductor")
    compare(eager, fast, "cuda", 1e-4)


def test_knob_compiles_the_served_engine(tmp_path) -> None:
    """``model_kwargs.compile`` reaches the engine's policy: its blocks compiled, the rest eager."""
    from mstar.config import parse_config
    from mstar.model.pi05.model import Pi05
    from tests.support.pi05 import write_checkpoint

    write_checkpoint(tmp_path)
    engines = {}
    for compile in (False, True):
        spec = Pi05(parse_config({"model": "pi05", "model_path": str(tmp_path), "load_format": "dummy",
                                  "model_kwargs": {"compile": compile, "compile_backend": "aot_eager"}}))
        engines[compile] = spec.build_engines({"policy"}, torch.device("cpu"))["policy"]
    assert all(b._compiled_call_impl is not None for b in expert_blocks(engines[True].model))
    assert all(b._compiled_call_impl is not None for b in prefix_blocks(engines[True].model))
    assert all(b._compiled_call_impl is None for b in expert_blocks(engines[False].model))
    assert engines[True].model.paligemma_with_expert.paligemma.model.language_model._compiled_call_impl is None
