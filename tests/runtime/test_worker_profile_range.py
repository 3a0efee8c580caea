"""A worker labels each node's work in a plan (``mstar.node.<name>``) while a torch profiler
records, and skips the label's cost while none does; the results are the same either way."""

from __future__ import annotations

import torch
from torch.profiler import profile

from mstar.engine.base import StatelessEngine
from mstar.runtime.protocol import StepPlan, VarRef, WorkItem
from mstar.runtime.transport import make_transport
from mstar.runtime.transport.inproc import InProcessHub
from mstar.runtime.worker import Worker


def _run_plans(profiled: bool) -> tuple[list, set[str]]:
    hub = InProcessHub()
    transports = {rank: make_transport("inproc", rank, hub=hub) for rank in (0, 1)}
    for rank, transport in transports.items():
        transport.connect({r: t.address for r, t in transports.items() if r != rank})
    engine = StatelessEngine(lambda op, items: [{"y": torch.ones(2)} for _ in items])
    worker = Worker(0, {"codec": engine}, transports[0], frontend_rank=1)
    plans = [StepPlan(i, [WorkItem(f"req-{i}", "codec", "run", "decode", 0, reads={},
                                   writes={"y": VarRef("audio", 1)})]) for i in (1, 2)]
    names: set[str] = set()
    try:
        if profiled:
            with profile() as prof:
                results = [worker.execute(plan) for plan in plans]
            names = {event.name for event in prof.events()}
        else:
            results = [worker.execute(plan) for plan in plans]
    finally:
        for transport in transports.values():
            transport.close()
    return [[(r.request_id, r.step, r.error) for r in result.results] for result in results], names


def test_a_nodes_range_is_recorded_under_the_profiler_and_results_do_not_change() -> None:
    plain, _ = _run_plans(profiled=False)
    recorded, names = _run_plans(profiled=True)
    assert "mstar.node.codec" in names
    assert recorded == plain == [[("req-1", "decode", None)], [("req-2", "decode", None)]]
