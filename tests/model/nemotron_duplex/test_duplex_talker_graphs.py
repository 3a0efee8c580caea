"""``cuda_graphs`` on the talker node (``eartts_talker``), on the CPU with the tiny deployment of
``test_nemotron_duplex_served.py``: its steady frames replay per bucket of calls (off CUDA: the
same buckets and static buffers run eagerly) and each call's PCM, tick by tick, equals the
eager node's, with calls joining, a text EOS, and a call's last chunk closing it mid-stream."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mstar.engine.base import EngineItem
from tests.e2e.test_nemotron_duplex_served import _config, checkpoint  # noqa: F401  (checkpoint: a fixture)
from tests.model.nemotron_duplex.test_duplex_build_dtype import spec_of
from tests.support.graph_device import DEVICE
from tests.support.host_reads import HostReads

TALKER = "eartts_talker"


def talker_node(folder: Path, graphs: bool):
    kwargs = _config(folder)["model_kwargs"] | {"cuda_graphs": graphs}
    return spec_of(folder, model_kwargs=kwargs).build_engines({TALKER}, DEVICE)[TALKER]


def speak(node, ticks: int) -> dict[str, list[torch.Tensor]]:
    """Calls ``a`` (ticks 0..), ``b`` (1..4, closed by its last chunk at 4), ``c`` (2..): each
    call's PCM per tick. ``a`` says EOS at tick 3."""
    eos = node.talker.text_eos_id
    spans = {"a": (0, ticks + 1), "b": (1, 5), "c": (2, ticks + 1)}  # a, c: not ended
    pcm = {rid: [] for rid in spans}
    for t in range(ticks):
        live = [rid for rid, (first, end) in spans.items() if first <= t < end]
        items = [EngineItem(rid, "", t, {"token": torch.tensor([eos if (rid, t) == ("a", 3) else 10 + 7 * t + i])},
                            {"talker_seed": 20 + i}, chunk=SimpleNamespace(last=t == spans[rid][1] - 1))
                 for i, rid in enumerate(live)]
        for rid, out in zip(live, node.run(items), strict=True):
            pcm[rid].append(out.outputs["audio"])
    return pcm


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the tiny talker's sliding window (6) binds, which the "
                    "Triton backend of CUDA graphs refuses; test_eartts_frame_graphs.py checks the CUDA replays")
@torch.no_grad()
def test_the_talker_with_cuda_graphs_speaks_as_eager(checkpoint: Path):  # noqa: F811
    eager, graphed = talker_node(checkpoint, False), talker_node(checkpoint, True)
    assert eager.talker.steady is None and graphed.talker.steady.batch_sizes == (1, 2, 4, 8, 16)  # 16 calls
    ticks = 7
    want, got = speak(eager, ticks), speak(graphed, ticks)
    assert graphed.talker.steady.graphs.captured_batch_sizes == (1, 2, 4)  # 1, 2 then 3 steady calls
    for rid, frames in want.items():
        peak = float(torch.cat(frames).abs().max())
        assert len(got[rid]) == len(frames)
        for a, b in zip(got[rid], frames, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4 * peak, rtol=0)
    for rid in ("a", "c"):  # still speaking: their last codes
        assert torch.equal(graphed.talker.sessions[rid].prev, eager.talker.sessions[rid].prev), rid
    assert graphed.talker.slots_used == 2 and graphed.talker.pages_used > 0
    # a graphed tick waits for the device once (the tick's PCM read back), as the eager one; the
    # CPU's graph attends with the torch reference, whose lengths read back (paged_kv.py: on CUDA
    # the Triton kernels, whose recorded step test_eartts_frame_graphs.py pins at zero reads)
    items = [EngineItem(rid, "", ticks, {"token": torch.tensor([9])}, {"talker_seed": 0},
                        chunk=SimpleNamespace(last=False)) for rid in ("a", "c")]
    with HostReads(ignore=("layers/paged_kv.py",)) as seen:
        graphed.run(items)
    assert seen.count() == 2 and not seen.uploads, seen.report()  # tolist of the host tokens, .cpu() of the PCM
    for rid in ("a", "c"):
        graphed.release(rid)
    assert graphed.talker.slots_used == 0 and graphed.talker.pages_used == 0
