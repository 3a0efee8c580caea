"""Classifier-free guidance in the denoise engine, with a tiny random FLUX.2 DiT as the velocity:
the batched pair against two separate forwards combined, the parallel ops (velocity, guide)
against the pair, and max_batch_size splitting forwards without changing results."""

import pytest
import torch

from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.diffusion.guidance import guide
from mstar.engine.base import EngineItem
from mstar.engine.denoise import DenoiseEngine
from mstar.model.flux2.config import Flux2TransformerConfig
from mstar.model.flux2.positions import image_ids, text_ids
from mstar.model.flux2.transformer import Flux2Transformer

ROWS, COLS, TEXT_LEN, TEXT_DIM, CHANNELS = 2, 3, 5, 24, 8
CONFIG = {"in_channels": CHANNELS, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
          "num_attention_heads": 2, "joint_attention_dim": TEXT_DIM, "timestep_guidance_channels": 16,
          "axes_dims_rope": (2, 2, 2, 2), "guidance_embeds": False}


@pytest.fixture(scope="module")
def velocity():
    dit = Flux2Transformer(Flux2TransformerConfig.from_dict(CONFIG)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in dit.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.3 if p.dim() > 1 else 0.05))

    def run(latents, text, t, params):
        rows, cols = params[0]["rows"], params[0]["cols"]
        return dit(latents, text, t, image_ids(rows, cols), text_ids(text.shape[1]), guidance=None)

    return run


def engine(velocity, max_batch_size=None):
    return DenoiseEngine(velocity, FlowMatchEuler(), torch.device("cpu"), torch.float32, max_batch_size)


def params(steps=4, guidance=None, rows=ROWS, cols=COLS):
    out = {"num_steps": steps, "image_seq_len": rows * cols, "rows": rows, "cols": cols}
    return out if guidance is None else {**out, "guidance_scale": guidance}


def make_item(rid, seed, iteration=0, guidance=None, op="step", rows=ROWS, cols=COLS, negative=True, **extra):
    g = torch.Generator().manual_seed(seed)
    inputs = {"latents": torch.randn(rows * cols, CHANNELS, generator=g),
              "text": torch.randn(TEXT_LEN, TEXT_DIM, generator=g)}
    if negative:
        inputs["negative_text"] = torch.randn(TEXT_LEN, TEXT_DIM, generator=g)
    inputs.update(extra)
    return EngineItem(rid, op, iteration, inputs, params(guidance=guidance, rows=rows, cols=cols))


def by_hand(velocity, item):
    """One guided (or plain) Euler step of one request with its own forwards, written out."""
    sigmas, timesteps = FlowMatchEuler().timesteps(item.params["num_steps"], item.params["image_seq_len"])
    k = item.iteration
    t = timesteps[k:k + 1] / 1000
    latents = item.inputs["latents"][None]
    v = velocity(latents, item.inputs["text"][None], t, [item.params])
    g = item.params.get("guidance_scale", 1.0)
    if g > 1:
        v_uncond = velocity(latents, item.inputs["negative_text"][None], t, [item.params])
        v = v_uncond + g * (v - v_uncond)
    return (latents + (sigmas[k + 1] - sigmas[k]) * v)[0]


def latents_of(outputs):
    return [out.outputs["latents"] for out in outputs]


def test_unguided_steps_are_the_plain_euler_step_of_one_batched_forward(velocity):
    items = [make_item(f"r{i}", i, iteration=i, negative=i == 1) for i in range(3)]
    e = engine(velocity)
    got = latents_of(e.run(items))
    assert list(e.forward_rows) == [3]
    sigmas, timesteps = FlowMatchEuler().timesteps(4, ROWS * COLS)
    latents = torch.stack([item.inputs["latents"] for item in items])
    text = torch.stack([item.inputs["text"] for item in items])
    with torch.inference_mode():
        v = velocity(latents, text, timesteps[:3] / 1000, [item.params for item in items])
        want = FlowMatchEuler.step(latents, v, sigmas[:3], sigmas[1:4])
    for row in range(3):
        assert torch.equal(got[row], want[row])  # unguided requests: bit for bit the plain step


def test_batched_pair_equals_two_separate_forwards_combined(velocity):
    items = [make_item("g4", 1, iteration=1, guidance=4.0), make_item("plain", 2, iteration=0),
             make_item("g2", 3, iteration=3, guidance=2.5), make_item("one", 4, iteration=2, guidance=1.0)]
    e = engine(velocity)
    got = latents_of(e.run(items))
    assert list(e.forward_rows) == [6]  # 2 + 1 + 2 + 1 rows in one forward
    for item, out in zip(items, got):
        want = by_hand(velocity, item)
        # guidance multiplies the rounding of a batched GEMM by up to 2g + 1
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # guidance matters: the guided result is far from the conditional-only step
    plain = by_hand(velocity, make_item("g4", 1, iteration=1))
    assert (got[0] - plain).abs().max() > 1e-2


def test_parallel_branches_then_guide_equal_the_batched_pair(velocity):
    pair = make_item("p", 5, iteration=2, guidance=4.0)
    lat, text, neg = (pair.inputs[k] for k in ("latents", "text", "negative_text"))
    cond = EngineItem("p", "velocity", 2, {"latents": lat, "text": text}, pair.params)
    uncond = EngineItem("p", "velocity", 2, {"latents": lat, "text": neg}, pair.params)
    e = engine(velocity)
    v_cond = e.run([cond])[0].outputs["velocity"]
    v_uncond = engine(velocity).run([uncond])[0].outputs["velocity"]  # another rank: its own engine
    [stepped] = latents_of(e.run([EngineItem("p", "guide", 2, {"latents": lat, "v_cond": v_cond,
                                                               "v_uncond": v_uncond}, pair.params)]))
    # one row per forward on both sides: the same arithmetic, bit for bit
    [want] = latents_of(engine(velocity, max_batch_size=1).run([pair]))
    assert torch.equal(stepped, want)
    # and within a shared forward, the velocity rows match the pair's rows
    both = engine(velocity).run([cond, uncond, pair])
    torch.testing.assert_close(both[0].outputs["velocity"], v_cond, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(both[2].outputs["latents"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("limit, forwards", [(1, [1] * 8), (3, [3, 3, 2]), (5, [5, 3]), (8, [8]), (64, [8])])
def test_max_batch_size_splits_forwards_and_keeps_results(velocity, limit, forwards):
    items = [make_item(f"r{i}", 10 + i, iteration=i % 4, guidance=3.0 if i % 2 == 0 else None) for i in range(5)]
    whole = latents_of(engine(velocity).run(items))  # 3 guided pairs + 2 plain rows = 8 rows
    e = engine(velocity, max_batch_size=limit)
    split = latents_of(e.run(items))
    assert list(e.forward_rows) == forwards
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rows_of_other_shapes_run_in_their_own_forwards(velocity):
    items = [make_item("a", 1, guidance=4.0), make_item("b", 2, rows=3, cols=3), make_item("c", 3, guidance=2.0)]
    e = engine(velocity)
    got = latents_of(e.run(items))
    assert sorted(e.forward_rows) == [1, 4]
    for item, out in zip(items, got):
        torch.testing.assert_close(out, by_hand(velocity, item), rtol=1e-5, atol=1e-6)


def test_guided_step_without_negative_text_and_unknown_ops_are_errors(velocity):
    with pytest.raises(ValueError, match="negative_text"):
        engine(velocity).run([make_item("x", 1, guidance=4.0, negative=False)])
    with pytest.raises(ValueError, match="no op 'decode'"):
        engine(velocity).run([make_item("x", 1, op="decode")])
    with pytest.raises(ValueError, match="max_batch_size"):
        engine(velocity, max_batch_size=0)


def test_release_forgets_the_schedule(velocity):
    e = engine(velocity)
    e.run([make_item("x", 1, guidance=4.0)])
    assert "x" in e.schedules
    e.release("x")
    assert not e.schedules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guide_rounds_like_the_pipeline_expression(dtype):
    g = torch.Generator().manual_seed(0)
    pos, neg = (torch.randn(3, 7, 5, generator=g).to(dtype) for _ in range(2))
    for scale in (4.0, 3.7, 1.0):
        assert torch.equal(guide(pos, neg, scale), neg + scale * (pos - neg))
    per_row = guide(pos, neg, torch.tensor([4.0, 3.7, 1.0]))
    for row, scale in enumerate((4.0, 3.7, 1.0)):
        assert torch.equal(per_row[row], (neg + scale * (pos - neg))[row])
