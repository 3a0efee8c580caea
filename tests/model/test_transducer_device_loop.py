"""The transducer's device loop (``device_steps``: no read of the device inside a decode
iteration) against the reference loop (``greedy_steps``): the same tokens and the same row
states after every iteration, TDT and RNN-T, on clips of different lengths that finish at
different steps of an iteration, and through the engine. On CUDA (skipped without it) the loop
runs under ``torch.cuda.set_sync_debug_mode("error")``: a read of the device inside fails it.
The iteration's CUDA graphs (``IterationGraphs``) run their buckets and frame buffer eagerly
on the CPU and are captured on CUDA; both decode as the reference engine."""

from __future__ import annotations

import pytest
import torch
from test_fastconformer_engine import clips, decoder, item, tiny_model

from mstar.model.fastconformer.engine import IterationGraphs, TransducerDecoder
from mstar.model.fastconformer.transducer import (
    GreedyRows,
    TransducerModel,
    device_steps,
    emitted,
    fresh_rows,
    greedy_decode,
    greedy_steps,
)
from tests.support.markers import needs_cuda

FRAMES = (9, 14, 5, 11, 1)


def copy_rows(rows: GreedyRows) -> GreedyRows:
    return GreedyRows(**{name: None if value is None else value.clone() for name, value in vars(rows).items()})


def assert_same_rows(got: GreedyRows, want: GreedyRows, tol: float = 1e-6) -> None:
    for name in ("cursor", "symbols", "budget", "lengths"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("hidden", "cell", "output"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=tol, atol=tol)


def compare_loops(model: TransducerModel, features: list[torch.Tensor], steps: int) -> list[list[int]]:
    """Both loops iteration by iteration from the same rows; returns the whole transcripts."""
    reference = fresh_rows(model, features)
    rows = copy_rows(reference)
    transcripts: list[list[int]] = [[] for _ in features]
    iterations = 0
    while not bool(reference.done().all()):
        want = greedy_steps(model, reference, steps)
        got = emitted(device_steps(model, rows, steps))
        assert got == want, f"iteration {iterations}"
        assert_same_rows(rows, reference)
        for transcript, new in zip(transcripts, got):
            transcript += new
        iterations += 1
    assert bool(rows.done().all())
    return transcripts


@pytest.mark.parametrize("tdt", [True, False])
@pytest.mark.parametrize("steps", [64, 5, 1])
def test_device_loop_matches_reference_loop(tdt: bool, steps: int) -> None:
    model = tiny_model(tdt=tdt)
    features = clips(model, FRAMES)
    transcripts = compare_loops(model, features, steps)
    assert transcripts == greedy_decode(model, features, max_steps=steps)
    assert len({tuple(t) for t in transcripts}) > 2 and all(transcripts[:4]), "a degenerate random decode"


def test_device_loop_stops_at_the_step_budget() -> None:
    """A TDT joint that always says a token of duration 0: each row stops at its budget, in
    the middle of an iteration, and its later steps change nothing."""
    model = tiny_model()
    with torch.no_grad():
        model.joint.head.weight.zero_()
        model.joint.head.bias.zero_()
        model.joint.head.bias[5] = 10.0
        model.joint.head.bias[model.config.vocab_size] = 10.0  # duration 0
    features = clips(model, (2, 3))
    transcripts = compare_loops(model, features, steps=7)
    assert transcripts == [[5] * 6, [5] * 9]  # frames x max_symbols_per_step (3)


def test_prediction_network_step_is_the_lstm() -> None:
    """The written-out cell equals ``nn.LSTM`` over one time step (fp32, CPU)."""
    net = tiny_model().decoder
    tokens = torch.tensor([3, 0, 7])
    hidden, cell = torch.randn(2, 2, 3, 12).unbind(0)  # [layers, rows, width] each
    want, (want_h, want_c) = net.lstm(net.embedding(tokens)[:, None], (hidden, cell))
    output, got_h, got_c = net.step(tokens, hidden, cell)
    torch.testing.assert_close(output, net.decoder_projector(want[:, 0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_c, want_c, rtol=1e-6, atol=1e-6)


def graphed(engine: TransducerDecoder, batch_sizes=(1, 2, 4), min_frames: int = 8) -> TransducerDecoder:
    """``engine`` replaying its iterations through ``IterationGraphs`` (a small frame buffer,
    so that it grows; batches above the last bucket run eagerly)."""
    engine.device_loop = True
    engine.graphs = IterationGraphs(engine.model, engine.steps, batch_sizes, engine.output.device,
                                    engine.output.dtype, min_frames=min_frames)
    return engine


def run_staggered(engines: dict, features: list[torch.Tensor]) -> None:
    """Clips joining one per tick and leaving when done, through every engine alike: each tick's
    tokens, end flags and finish reasons are the same in all."""
    live = {name: {} for name in engines}
    for tick in range(100):
        plans = {}
        for loop, engine in engines.items():
            if tick < len(features):
                live[loop][f"r{tick}"] = 0
            names = list(live[loop])
            outputs = engine.run([item(n, features[int(n[1:])], live[loop][n]) for n in names]) if names else []
            plans[loop] = []
            for name, out in zip(names, outputs):
                tokens = out.outputs["tokens"].tolist() if "tokens" in out.outputs else []
                plans[loop].append((name, tokens, out.flags, out.finish_reason))
                live[loop][name] += 1
                if "stop" in out.flags:
                    del live[loop][name]
                    engine.release(name)
        assert all(plan == plans["reference"] for plan in plans.values()), f"tick {tick}"
        if not live["reference"] and tick >= len(features):
            break
    assert not any(live.values()) and all(engine.slots.num_used == 0 for engine in engines.values())


@pytest.mark.parametrize("tdt", [True, False])
def test_engine_with_device_loop_decodes_as_reference_engine(tdt: bool) -> None:
    """Clips joining and leaving between iterations: the engine's tokens, end flags and
    finish reasons are the same with either loop, and with the loop through the iteration
    graphs' buckets (eager on the CPU), its frame buffer growing twice."""
    model = tiny_model(tdt=tdt)
    features = clips(model, FRAMES)
    engines = {name: decoder(model, max_slots=6, steps=4) for name in ("reference", "device_loop", "graphs")}
    engines["reference"].device_loop = False
    engines["device_loop"].device_loop = True
    graphed(engines["graphs"])
    run_staggered(engines, features)
    assert engines["graphs"].graphs.frames.shape[0] > 16, "the frame buffer grew"


@needs_cuda
@pytest.mark.parametrize("tdt", [True, False])
def test_cuda_device_loop_reads_nothing_inside_an_iteration(tdt: bool) -> None:
    model = tiny_model(tdt=tdt).cuda()
    features = [f.cuda() for f in clips(model, FRAMES)]
    reference = fresh_rows(model, features)
    rows = copy_rows(reference)
    for iteration in range(40):
        if bool(reference.done().all()):
            break
        want = greedy_steps(model, reference, 8)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            table = device_steps(model, rows, 8)  # a read of the device in here raises
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert emitted(table) == want, f"iteration {iteration}"
        # the reference runs the LSTM and joint on the live rows only, where cuBLAS may pick
        # other kernels than for all rows: fp32 states agree to rounding, tokens exactly
        assert_same_rows(rows, reference, tol=1e-5)
    assert bool(rows.done().all())


@needs_cuda
@pytest.mark.parametrize("tdt", [True, False])
def test_cuda_graphed_iterations_decode_as_reference_engine(tdt: bool) -> None:
    """The iterations captured as CUDA graphs (fp32, buckets 1-4, the frame buffer growing and
    its graphs captured again) say what the eager reference engine says, tick by tick."""
    model = tiny_model(tdt=tdt).cuda()
    features = [f.cuda() for f in clips(model, FRAMES)]
    engines = {name: TransducerDecoder(model, max_slots=6, steps_per_iteration=4, device=torch.device("cuda"),
                                       dtype=torch.float32) for name in ("reference", "graphs")}
    engines["reference"].device_loop = False
    graphed(engines["graphs"])
    run_staggered(engines, features)
    assert engines["graphs"].graphs.runner.capture and engines["graphs"].graphs.runner.keys


@needs_cuda
def test_cuda_engine_defaults_to_the_device_loop_in_bf16() -> None:
    """On CUDA the engine runs the device loop by default; in bf16 its transcripts are those of
    the reference loop in bf16."""
    model = tiny_model().cuda().to(torch.bfloat16)
    features = [f.cuda().to(torch.bfloat16) for f in clips(model, FRAMES)]
    engine = TransducerDecoder(model, max_slots=6, steps_per_iteration=64, device=torch.device("cuda"),
                               dtype=torch.bfloat16)
    assert engine.device_loop
    tokens: dict[str, list[int]] = {}
    live = {f"r{i}": 0 for i in range(len(features))}
    while live:
        names = list(live)
        for name, out in zip(names, engine.run([item(n, features[int(n[1:])], live[n]) for n in names])):
            tokens.setdefault(name, []).extend(out.outputs["tokens"].tolist() if "tokens" in out.outputs else [])
            live[name] += 1
            if "stop" in out.flags:
                del live[name]
                engine.release(name)
    assert [tokens[f"r{i}"] for i in range(len(features))] == greedy_decode(model, features, max_steps=64)
