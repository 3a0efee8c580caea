"""The transducer's device loop (``device_steps``: no read of the device inside a decode
iteration) against the reference loop (``greedy_steps``): the same tokens and the same row
states after every iteration, TDT and RNN-T, on clips of different lengths that finish at
different steps of an iteration, and through the engine. On CUDA (skipped without it) the loop
runs under ``torch.cuda.set_sync_debug_mode("error")``: a read of the device inside fails it."""

from __future__ import annotations

import pytest
import torch
from test_fastconformer_engine import clips, decoder, item, tiny_model

from mstar.model.fastconformer.engine import TransducerDecoder
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
    return GreedyRows(**{name: value.clone() for name, value in vars(rows).items()})


def assert_same_rows(got: GreedyRows, want: GreedyRows) -> None:
    for name in ("cursor", "symbols", "budget", "lengths"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("hidden", "cell", "output"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-6)


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


@pytest.mark.parametrize("tdt", [True, False])
def test_engine_with_device_loop_decodes_as_reference_engine(tdt: bool) -> None:
    """Clips joining and leaving between iterations: the engine's tokens, end flags and
    finish reasons are the same with either loop."""
    model = tiny_model(tdt=tdt)
    features = clips(model, FRAMES)
    engines = {loop: decoder(model, max_slots=6, steps=4) for loop in (False, True)}
    for loop, engine in engines.items():
        engine.device_loop = loop
    live = {loop: {} for loop in engines}
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
        assert plans[True] == plans[False], f"tick {tick}"
        if not live[True] and tick >= len(features):
            break
    assert not live[False] and engines[True].slots.num_used == 0


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
        assert_same_rows(rows, reference)
    assert bool(rows.done().all())


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
