"""The interface every engine presents to its worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class EngineItem:
    """One request's step, with its input tensors gathered by the worker."""

    request_id: str
    op: str
    iteration: int
    inputs: dict[str, torch.Tensor]
    params: dict[str, Any]
    chunk: Any = None  # a ChunkRef when the step consumes a stream edge (keep range, last)
    # a ``mstar.runtime.sessions.SessionHandle`` when the request runs in a session: the
    # node's state kept for it between requests (``get`` / ``put`` / ``drop``)
    session: Any = None


@dataclass
class EngineOutput:
    """One item's result. An output port missing from ``outputs`` produced nothing this step
    (e.g. an LLM step whose token is not an audio code): it is not sent, and a stream fed
    by it gets no item. ``preempted``: the engine did not run the step now (too few KV
    pages); it has no outputs, and the step is to be sent again."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    finish_reason: str | None = None
    preempted: bool = False


class Engine(ABC):
    """Runs the batched steps of one node. ``run`` gets every ready item of the node in a
    plan (several requests, possibly several ops) and returns one output per item, in
    order. An exception fails the batch; the worker then retries each item alone, so
    only the request that causes it fails."""

    @abstractmethod
    def run(self, items: list[EngineItem]) -> list[EngineOutput]: ...

    def release(self, request_id: str) -> None:  # noqa: B027 (a no-op hook: a stateless engine holds nothing)
        """Free everything the engine holds for the request (KV pages, state slots)."""

    def stats(self) -> dict[str, float]:
        """Resource gauges for /metrics (pages in use, ...)."""
        return {}


class StatelessEngine(Engine):
    """Runs a plain function of tensors per item: encoders, vocoders, VAEs. Items with
    the same op are handed over together so the function may batch them."""

    def __init__(self, fn):
        self.fn = fn  # fn(op, list[EngineItem]) -> list[dict[str, Tensor]]

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        outputs: list[EngineOutput | None] = [None] * len(items)
        by_op: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            by_op.setdefault(item.op, []).append(i)
        for op, indices in by_op.items():
            with torch.inference_mode():
                results = self.fn(op, [items[i] for i in indices])
            for i, result in zip(indices, results):
                outputs[i] = EngineOutput(result)
        return outputs  # type: ignore[return-value]


