"""The model's forward over a step's new tokens: the autoregressive engine's forward side.

``Forward`` runs a plain decoder: ``model.forward(input_ids, meta, kv_caches)``, then
``model.compute_logits``. A model that reads per-request device state besides the paged KV
cache subclasses it and hands an instance to the engine (``AutoregressiveEngine(...,
forward=...)``): Whisper's decoder cross-attends to K/V slots written at its prefill
(``mstar.model.whisper.engine``); Qwen3.5's DeltaNet layers carry recurrent-state slots, and
its prefills take media embeddings (``mstar.model.qwen3_5.engine``). A forward owns that
state: a step takes it in ``prepare``, ``release`` frees it, ``stats`` reports it.

The engine reads from the forward what its fast paths may do: decode steps replay CUDA graphs
only when ``graph_rows`` is not None, overlap scheduling runs only when ``runs_ahead``
(a step launched ahead is discarded when its row leaves the next plan; state the forward
cannot roll back would be left advanced); prefix caching only when ``kv_from_tokens``
(pages of a prefix computed for one request are reused by another only if a position's K/V
depend on the token ids up to it and nothing else); and a sequence is preempted when the KV
pages run out only when ``preemptible`` (its pages are freed, and its next step recomputes its
tokens from position 0 over nothing but the paged cache and the state ``prepare`` keeps per
request).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from mstar.engine.base import EngineItem
from mstar.engine.state_pool import StatePool
from mstar.layers.paged_kv import PagedAttentionMetadata


class Decoder(Protocol):
    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class Forward:
    """A plain decoder's forward: no state but the paged KV cache."""

    runs_ahead = True  # its per-request state survives a discarded step launched ahead
    kv_from_tokens = True  # a position's K/V are a function of the token ids up to it alone
    preemptible = True  # a sequence's KV recomputed from its tokens alone is the same KV

    def __init__(self, model: Decoder) -> None:
        self.model = model
        # The per-row inputs a decode graph reads besides the ids and the paged metadata, each
        # with the value of a padded row (an index, or a row tensor of the input's shape and
        # dtype); None: decode steps never replay a graph.
        self.graph_rows: dict[str, int | torch.Tensor] | None = {}

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        """The step's inputs besides the ids and metadata, for ``hidden`` (a request's first
        step takes its state here). ``counts[b]``: item ``b``'s new tokens (None: one each).
        With ``graph_rows``, a decode-only step's (``counts`` None) are exactly those inputs, one
        value per row."""
        return {}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's new tokens."""
        return self.model.forward(input_ids, meta, kv_caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def graph_step(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                   rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """What a decode graph records, over its static inputs: the step's logits."""
        return self.logits(self.hidden(input_ids, meta, kv_caches, rows, None))

    def graph_logits(self, replayed: torch.Tensor) -> torch.Tensor:
        """The logits of a replay's rows of ``graph_step``'s output."""
        return replayed

    def failed(self, request_ids: list[str]) -> None:
        """A step of these requests failed after its forward began (nothing to undo here: the
        engine rolls the KV pages back)."""

    def release(self, request_id: str) -> None:
        """Free the request's state."""

    def stats(self) -> dict[str, float]:
        return {}


class SlotForward(Forward):
    """A forward whose model keeps a recurrent state per request (gated DeltaNet, Mamba-2): one
    slot of every tensor of ``slot_tensors()`` (``[max_slots, ...]`` each) per request, from
    ``states`` (``mstar.engine.state_pool.StatePool``), zeroed when handed out and freed at
    release. A state advances in place, so a batch that fails once its forward began leaves its
    requests' states *lost*: a later step of theirs (the worker's one-by-one retry) fails rather
    than continue from a state that moved; a fresh request's slot is simply released."""

    runs_ahead = False  # a step launched ahead would advance a state it cannot roll back
    preemptible = False

    def __init__(self, model: Any, max_slots: int) -> None:
        super().__init__(model)
        self.graph_rows = None  # a subclass whose decode step reads its slots by index may graph it
        self.states = StatePool(max_slots)
        self.lost: set[str] = set()

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every per-slot state tensor (the layers' conv windows and recurrent states)."""
        raise NotImplementedError

    def slot(self, request_id: str) -> int:
        """The request's slot, a fresh zeroed one on its first step."""
        if request_id in self.lost:
            raise RuntimeError(f"request {request_id}: its recurrent state was lost when an earlier batch failed")
        if self.states.has(request_id):
            return self.states.slot(request_id)
        slot = self.states.allocate(request_id)
        for tensor in self.slot_tensors():
            tensor[slot].zero_()
        return slot

    def failed(self, request_ids: list[str]) -> None:
        self.lost.update(request_id for request_id in request_ids if self.states.has(request_id))

    def release(self, request_id: str) -> None:
        self.states.free(request_id)
        self.lost.discard(request_id)

    def stats(self) -> dict[str, float]:
        return {"state_slots_used": self.states.num_used, "state_slots_total": self.states.capacity}
