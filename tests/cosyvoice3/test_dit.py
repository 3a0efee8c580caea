"""The DiT estimator (``mstar.model.cosyvoice3.dit``) against CosyVoice3's ``DiT``, recorded by
``record_reference.py`` from the official code (ace7c47; x-transformers 2.11.24, absent from
the project venv), plus the invariants the streaming decode relies on. Tiny config, float32,
CPU: 2 blocks of width 32, 4 heads of 8, chunks of 8 frames, a padded batch of two."""

from __future__ import annotations

import pytest
import torch

from mstar.model.cosyvoice3 import DiTConfig, DiTEstimator, dit_name_map
from mstar.model.cosyvoice3.dit import rotate_first_head
from mstar.model.flow import FlowEstimator
from mstar.model.weights import load_weights

TOL = 1e-5  # of the reference's peak


def config(case: dict) -> DiTConfig:
    d = case["dit"]
    return DiTConfig(dim=d["dim"], depth=d["depth"], heads=d["heads"], head_dim=d["dim_head"], ff_mult=d["ff_mult"],
                     static_chunk_size=d["static_chunk_size"])


def estimator(case: dict) -> DiTEstimator:
    model = DiTEstimator(config(case)).eval()
    prefix = "decoder.estimator."
    state = {k[len(prefix):]: v for k, v in case["state"].items() if k.startswith(prefix)}
    load_weights(model, state.items(), name_map=dit_name_map)  # strict both ways
    return model


def peak_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "chunked"])
def test_velocity_matches_reference(reference, streaming: bool) -> None:
    case = reference["flow"]
    inputs = case["estimator_inputs"]
    stack = FlowEstimator.conditioning(inputs["mu"], inputs["spks"], inputs["cond"])
    with torch.no_grad():
        got = estimator(case)(inputs["x"], inputs["mask"], stack, inputs["t"], streaming=streaming)
    want = case["velocity_streamed" if streaming else "velocity"]
    err = peak_err(got, want)
    print(f"[parity] DiT velocity ({'chunked' if streaming else 'whole'}): max err {err:.2e} of peak")
    assert err <= TOL


def random_inputs(frames: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, stack = torch.randn(1, 80, frames, generator=g), torch.randn(1, 240, frames, generator=g)
    return x, torch.ones(1, 1, frames), stack, torch.rand(1, generator=g)


def test_chunked_velocity_of_a_prefix_is_the_prefix_of_the_whole(reference) -> None:
    model = estimator(reference["flow"])
    chunk = model.config.static_chunk_size
    x, mask, stack, t = random_inputs(5 * chunk)
    with torch.no_grad():
        whole = model(x, mask, stack, t, streaming=True)
        for chunks in (1, 2, 4):
            n = chunks * chunk
            prefix = model(x[..., :n], mask[..., :n], stack[..., :n], t, streaming=True)
            assert (prefix - whole[..., :n]).abs().max() <= TOL * whole.abs().max()


def test_future_frames_reach_earlier_chunks_only_without_streaming(reference) -> None:
    model = estimator(reference["flow"])
    chunk = model.config.static_chunk_size
    x, mask, stack, t = random_inputs(3 * chunk, seed=1)
    later = x.clone()
    later[..., 2 * chunk:] += 1.0  # change only the third chunk
    with torch.no_grad():
        for streaming in (True, False):
            a = model(x, mask, stack, t, streaming=streaming)[..., :2 * chunk]
            b = model(later, mask, stack, t, streaming=streaming)[..., :2 * chunk]
            moved = (a - b).abs().max().item()
            assert (moved == 0.0) if streaming else (moved > 1e-3), (streaming, moved)


def test_rotary_turns_the_first_head_only() -> None:
    g = torch.Generator().manual_seed(0)
    heads, head_dim, frames = 3, 8, 5
    x = torch.randn(2, frames, heads * head_dim, generator=g)
    model = DiTEstimator(DiTConfig(dim=16, depth=1, heads=heads, head_dim=head_dim, pos_groups=4))
    cos, sin = model.rope(frames)
    out = rotate_first_head(x, cos, sin)
    assert torch.equal(out[..., head_dim:], x[..., head_dim:])
    pairs = torch.view_as_complex(x[..., :head_dim].reshape(2, frames, -1, 2).contiguous())
    angles = torch.arange(frames)[:, None] * model.rotary_inv_freq[None]
    by_hand = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    assert torch.allclose(out[..., :head_dim], by_hand, atol=1e-6)
