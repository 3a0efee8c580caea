"""CUDA-graph replay of a launch-bound forward, one graph per input shape.

A diffusion family's text encoder runs once per request over a prompt padded to a fixed
length (klein: 512 tokens) at batch 1..a few: a thousand small kernels whose launches take
longer on the host than the kernels take on the GPU. ``GraphedForward`` captures
``fn(*inputs) -> Tensor`` once per key (the caller's: the inputs' shapes and whatever
Python-level choice changes the launched kernels) and replays it: the inputs are copied into
the graph's static buffers, the graph is launched, and a copy of its output is returned
(the next replay overwrites the static one). ``fn`` must be capturable: no host syncs, no
data-dependent shapes. The same kernels run as eagerly, so the output equals eager's.

All graphs share one memory pool: they are replayed one at a time and each output is copied
out at once, so no graph needs another's memory to survive. Past ``max_graphs`` keys the
forward runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from mstar.engine.cuda_graphs import capture_graph

DEFAULT_MAX_GRAPHS = 16
WARMUP_RUNS = 2  # before a capture: lazy initialisation (cuBLAS workspaces, kernel choice) stays out of it


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


class GraphedForward:
    def __init__(self, fn: Callable[..., torch.Tensor], max_graphs: int = DEFAULT_MAX_GRAPHS):
        self.fn = fn
        self.max_graphs = max_graphs
        self.graphs: dict[Hashable, _Captured] = {}
        self._pool = None

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> torch.Tensor:
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                return self.fn(*inputs)
            captured = self.graphs[key] = self._capture(inputs)
        for static, value in zip(captured.inputs, inputs):
            static.copy_(value, non_blocking=True)
        captured.graph.replay()
        return captured.output.clone()

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = tuple(x.clone() for x in inputs)
        graph, output = capture_graph(lambda: self.fn(*static), self._pool, warmups=WARMUP_RUNS)
        return _Captured(graph, static, output)
