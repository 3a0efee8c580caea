"""The duplex encoder's steady ticks from CUDA graphs (``model_kwargs.cuda_graphs``), checked on
the CPU, where ``BucketGraphs`` runs the recorded step eagerly over the same static buffers,
padding and buckets: calls that join and leave mid-stream give the frames the eager engine
gives; a steady tick of 3 calls replays the bucket of 4 (one padded row, on the sink slot);
the recorded step reads nothing back and uploads nothing (what a capture needs); and the
conformer blocks launch as many kernels at 4 calls as at 1 (no per-call loop: on the H200
the eager encoder took 35 ms at one call and 151 ms at 32)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mstar.engine.base import EngineItem
from tests.e2e.test_nemotron_duplex_served import FRAME, _config, checkpoint, speech  # noqa: F401  (a fixture)
from tests.model.nemotron_duplex.test_duplex_build_dtype import spec_of
from tests.support.graph_device import DEVICE, REPLAYS_RUN_PYTHON, on_cuda_replays_run_no_python
from tests.support.host_reads import HostReads

ENCODER = "conformer_encoder"
# tick -> the calls that append a frame (their last append ends the call)
SCHEDULE = {0: "a", 1: "a", 2: "ab", 3: "abc", 4: "abc", 5: "abc", 6: "abc", 7: "bc", 8: "bc", 9: "c"}
LAST = {"a": 6, "b": 8, "c": 9}


def build(folder: Path, graphs: bool):
    kwargs = _config(folder)["model_kwargs"] | {"cuda_graphs": graphs}
    return spec_of(folder, model_kwargs=kwargs).build_engines({ENCODER}, DEVICE)[ENCODER]


def run_schedule(engine) -> dict[tuple[str, int], torch.Tensor]:
    audio = {call: torch.from_numpy(speech(1.0, seed=i)) for i, call in enumerate("abc")}
    start = {call: min(t for t, calls in SCHEDULE.items() if call in calls) for call in "abc"}
    out = {}
    for tick, calls in SCHEDULE.items():
        items = []
        for call in calls:
            at = (tick - start[call]) * FRAME
            items.append(EngineItem(call, "", tick, {"audio": audio[call][at:at + FRAME]}, {},
                                    chunk=SimpleNamespace(last=tick == LAST[call])))
        for call, output in zip(calls, engine.run(items)):
            out[(call, tick)] = output.outputs.get("frames", torch.zeros(0))
        for call in calls:
            if tick == LAST[call]:
                engine.release(call)
    return out


@pytest.fixture(scope="module")
def engines(checkpoint: Path):  # noqa: F811
    return build(checkpoint, graphs=False), build(checkpoint, graphs=True)


def test_graphed_ticks_equal_eager_as_calls_join_and_leave(engines):
    eager, graphed = engines
    want, got = run_schedule(eager), run_schedule(graphed)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=str(key))
    assert sum(f.shape[0] for f in got.values()) > len(SCHEDULE)  # frames came out
    if REPLAYS_RUN_PYTHON:
        assert graphed.graphs.captured_batch_sizes == (1, 2, 4)  # a tick of 3 calls replays 4
    assert graphed.pool.num_used == 0 and not graphed.fronts
    assert not any(graphed.streams.calls)


def test_the_recorded_step_neither_reads_back_nor_uploads(engines):
    _, graphed = engines
    rows = {name: buffer[:4] for name, buffer in graphed.graphs.buffers.items()}
    with torch.inference_mode(), HostReads() as seen:
        graphed._frame(rows)
    assert seen.count() == 0 and not seen.uploads, seen.report()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@on_cuda_replays_run_no_python  # and counts the CPU's ATen calls
def test_the_blocks_launch_as_many_kernels_at_four_calls_as_at_one(engines):
    eager, _ = engines
    streams = eager.streams
    counts = []
    for calls in (1, 4):
        x = torch.randn(calls, 1, streams.encoder.config.hidden_size)
        inputs = [torch.arange(calls), torch.full((calls,), 3), torch.ones(calls, dtype=torch.int64)]
        for slot in range(calls):
            streams.open(slot)
        with torch.inference_mode(), _Ops() as seen:
            streams.blocks(x, *inputs)
        for slot in range(calls):
            streams.close(slot)
        counts.append(seen.ops)
    assert counts[0] == counts[1]
    assert sum(counts[0].values()) < 100 * len(streams.encoder.layers)  # ~85 ATen calls a layer
