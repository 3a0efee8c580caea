"""The talker's steady frames from CUDA graphs (``cuda_graphs``), checked on the CPU, where the
same buckets, padding and static buffers run eagerly: the frames equal the eager engine's
(codes exactly, PCM within 1e-4 of peak as batched against solo eager frames: the padded
batch convolves in another order)
across a session's warm-up frame and its steady ones, at one session and at three (bucket 4,
one padded row), with a session joining and one leaving mid-stream, one on other sampling
knobs (eager beside the replay) and a text EOS; and the step a graph records reads nothing
back from the device (``HostReads``, the Triton kernels under the interpreter)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from mstar.model.eartts.checkpoint import EarTTS
from mstar.model.eartts.engine import Sampling, TalkerEngine
from mstar.model.eartts.frame_graphs import buckets_up_to
from tests.model.eartts.eartts_fixture import built, reference
from tests.model.eartts.test_eartts_engine import _warmup
from tests.support.host_reads import HostReads

if not torch.cuda.is_available():  # before Triton's first import: its kernels run interpreted on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

EOS, FRAMES, PAGE = 3, 7, 4
WARMUP = 5  # _warmup's positions
GREEDIER = Sampling(guidance=0.0, top_p=4, noise_scale=0.5)


@pytest.fixture(scope="module")
def model():
    return built(reference())


def _engine(model, sessions: int, graphs: bool, **kw) -> TalkerEngine:
    return TalkerEngine(model, max_sessions=sessions, num_pages=64, page_size=PAGE, text_eos_id=EOS,
                        max_positions=WARMUP + FRAMES, cuda_graphs=graphs, **kw)


def _tokens(seed: int) -> list[int]:
    tokens = torch.randint(4, 20, (FRAMES,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
    tokens[3] = EOS  # a steady frame spoken from the silence frame
    return tokens


def _script(engine: TalkerEngine, plan: dict[str, tuple[int, int, Sampling | None]], steps: int):
    """Each session ``sid: (seed, first step, frames before it leaves, sampling)``: its codes
    and PCM (the closing tail included)."""
    codes = {s: [] for s in plan}
    pcm = {s: [] for s in plan}
    for step in range(steps):
        for sid, (seed, first, _, sampling) in plan.items():
            if step == first:
                engine.open(sid, _warmup(engine.model, seed), seed=seed, sampling=sampling)
        live = {sid: _tokens(seed)[len(codes[sid])] for sid, (seed, _, _, _) in plan.items() if sid in engine.sessions}
        for sid, frame in engine.step(live).items():
            codes[sid].append(frame.codes)
            pcm[sid].append(frame.pcm)
        for sid, (_, _, frames, _) in plan.items():
            if sid in engine.sessions and len(codes[sid]) == frames:
                pcm[sid].append(engine.close(sid))
    return {s: (torch.stack(codes[s]), torch.cat(pcm[s])) for s in plan if codes[s]}


@torch.no_grad()
@pytest.mark.parametrize("calls", [1, 3])
def test_graphed_frames_equal_eager(model, calls):
    """``a`` alone first; at 3 calls ``b`` joins at the second step (its warm-up eager beside
    ``a``'s replay) and ``c`` at the third: steps of 1, 2 and 3 graphed sessions (buckets 1, 2
    and 4, one padded row); ``b`` leaves after four frames and ``d`` (other sampling knobs:
    eager beside the replays) takes its slot."""
    plan = {"a": (1, 0, FRAMES, None)}
    if calls == 3:
        plan |= {"b": (2, 1, 4, None), "c": (3, 2, FRAMES - 2, None), "d": (4, 5, 3, GREEDIER)}
    steps = 8 if calls == 3 else FRAMES
    eager = _script(_engine(model, calls, False), plan, steps)
    engine = _engine(model, calls, True)
    replayed = []
    record = engine.steady.graphs.runner.step
    engine.steady.graphs.runner.step = lambda bucket: replayed.append(bucket) or record(bucket)
    graphed = _script(engine, plan, steps)
    assert engine.steady.batch_sizes == buckets_up_to(calls) == ((1,) if calls == 1 else (1, 2, 4))
    assert set(replayed) == ({1} if calls == 1 else {1, 2, 4}), replayed
    for sid, (codes, pcm) in eager.items():
        assert torch.equal(graphed[sid][0], codes), sid
        torch.testing.assert_close(graphed[sid][1], pcm, atol=1e-4 * float(pcm.abs().max()), rtol=0)
    assert engine.pages_used == 0 and engine.slots_used == 0


def test_buckets_up_to_the_deployment():
    assert buckets_up_to(1) == (1,) and buckets_up_to(32) == (1, 2, 4, 8, 16, 32)
    assert buckets_up_to(20) == (1, 2, 4, 8, 16, 32) and buckets_up_to(200)[-1] == 200


def test_engine_refuses_what_a_graph_cannot_run(model):
    with pytest.raises(ValueError, match="sliding window"):  # the fixture's window (6) binds at 12 positions
        _engine(model, 1, True, attention_backend="triton")
    with pytest.raises(ValueError, match="max_positions"):
        TalkerEngine(model, max_sessions=1, num_pages=8, page_size=PAGE, cuda_graphs=True)


def _wide_window(model: EarTTS) -> EarTTS:
    """The fixture with a window no session reaches (as the released 4096 against 2039)."""
    talker = dataclasses.replace(model.config.talker, sliding_window=64)
    wide = EarTTS(dataclasses.replace(model.config, talker=talker), text_vocab=model.talker.text.on.shape[0])
    wide.load_state_dict(model.state_dict())
    wide.talker.text.replace(model.talker.text.on, model.talker.text.off)
    wide.speakers = model.speakers
    return wide.eval()


@torch.no_grad()
def test_the_recorded_step_reads_nothing_back(model):
    """The step a bucket's graph records (``GraphRunner.step``), on the Triton backend (the
    kernels under Triton's interpreter on the CPU), makes no host read; the window dropped
    (wider than any stream) gives the same frames as the torch reference with it."""
    from mstar.layers import triton_attention
    from tests.support.triton_interpreter import index_interpreted_scalars, kernels_runnable

    if torch.cuda.is_available():
        pytest.skip("a CPU check: the fixture's tensors are host tensors, which the compiled kernels refuse")
    if not kernels_runnable(triton_attention):
        pytest.skip("triton was imported before TRITON_INTERPRET was set")
    if triton_attention.INTERPRET:
        index_interpreted_scalars()
    wide = _wide_window(model)
    # few steps (the interpreted kernels are slow); ``a`` steps alone at first: one graphed
    # row, whose flattened positions once were a stride-0 view the kernels misread
    steps = 4
    plan = {"a": (1, 0, steps, None), "b": (2, 1, 2, None)}
    reference_frames = _script(_engine(wide, 3, False), plan, steps)
    engine = _engine(wide, 3, True, attention_backend="triton")
    reads = []
    record = engine.steady.graphs.runner.step

    def watched(bucket):
        with HostReads() as seen:
            out = record(bucket)
        reads.append(seen)
        return out

    engine.steady.graphs.runner.step = watched
    frames = _script(engine, plan, steps)
    assert reads and all(seen.count() == 0 and not seen.uploads for seen in reads), [s.report() for s in reads]
    assert len(reads) == steps - 1  # a replay a step after the warm-up frame
    for sid, (codes, pcm) in reference_frames.items():
        assert torch.equal(frames[sid][0], codes), sid
        torch.testing.assert_close(frames[sid][1], pcm, atol=1e-4 * float(pcm.abs().max()), rtol=0)
    # the probe sees reads: the torch reference's decode reads its lengths back in the step
    torch_engine = _engine(wide, 1, True)
    torch_engine.open("a", _warmup(wide, 1), seed=1)
    torch_engine.step({"a": 5})
    torch_engine.step({"a": 6})
    with HostReads() as seen:
        torch_engine.steady.graphs.runner.step(1)
    assert seen.count() > 0


@pytest.mark.slow  # a pytest process of its own
def test_kernels_in_a_fresh_interpreter():
    """Where Triton was imported before ``TRITON_INTERPRET`` was set (the reads test skips),
    this file again in a process of its own."""
    from mstar.layers import triton_attention
    from tests.support.triton_interpreter import kernels_runnable, rerun_in_fresh_interpreter

    if torch.cuda.is_available() or kernels_runnable(triton_attention):
        pytest.skip("the kernel test runs in this process")
    rerun_in_fresh_interpreter(__file__)
