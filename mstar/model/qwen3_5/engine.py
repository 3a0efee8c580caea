"""The autoregressive engine of a hybrid model: paged KV for the attention layers plus one
recurrent-state slot per request for the DeltaNet layers.

A request gets its slot (zeroed) at its first step and gives it back in ``release``, which
the worker calls however the request ends; a failed first step releases it too (the base
engine undoes fresh requests). A recurrent state, unlike the KV cache, cannot be written
twice: if a batch fails once its forward pass has begun, the requests whose states may have
advanced are marked lost, and any later step of theirs (the worker's item-by-item retry)
fails with a clear error instead of decoding from a corrupted state.

A prefill of a request with images or videos also reads ``vision_embeds`` (the vision
node's output, one row per media token, prompt order) and ``mrope_positions`` (``[3, L]``):
the embeddings replace those of the media tokens, the positions drive MRoPE, and the
request's later steps run at ``position + rope_delta``. Text-only requests take the
text path unchanged. ``vision_fn`` is the vision node: every media of a plan's requests in
one forward of the ViT tower.
"""

from __future__ import annotations

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem, EngineOutput
from mstar.engine.state_pool import StatePool
from mstar.layers.gated_deltanet import StateBatch
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.qwen3_5.modeling import HybridCaches


class HybridEngine(AutoregressiveEngine):
    """``state_shapes`` are the per-slot shapes of one recurrent layer's ``conv`` window and
    ``recurrent`` state; ``num_state_layers`` such layers get ``[max_slots, *shape]`` tensors
    (the conv window in the model dtype, the recurrent state in ``state_dtype``)."""

    def __init__(self, model, layout: KVLayout, *, num_state_layers: int, state_shapes: dict[str, tuple[int, ...]],
                 max_slots: int, state_dtype: torch.dtype, media_token_ids: tuple[int, ...] = (), **kwargs):
        super().__init__(model, layout, **kwargs)
        self.media_token_ids = torch.tensor(media_token_ids, dtype=torch.int64, device=self.device)
        self.rope_deltas: dict[str, int] = {}
        self.states = StatePool(max_slots)
        dtype = kwargs["dtype"]
        self.conv_states = [torch.zeros(max_slots, *state_shapes["conv"], dtype=dtype, device=self.device)
                            for _ in range(num_state_layers)]
        self.recurrent_states = [torch.zeros(max_slots, *state_shapes["recurrent"], dtype=state_dtype,
                                             device=self.device) for _ in range(num_state_layers)]
        self.lost: set[str] = set()
        self._states_touched = False

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        self._states_touched = False
        try:
            return super().run(items)
        except BaseException:
            # Fresh requests were released by the base engine. The others' states are only
            # suspect if the forward pass began (a request refused before it costs nobody).
            if self._states_touched:
                self.lost.update(item.request_id for item in items if self.states.has(item.request_id))
            raise

    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, items: list[EngineItem]) -> torch.Tensor:
        slots = [self._slot(item.request_id) for item in items]
        batch = StateBatch.build(meta.query_start_loc.tolist(), slots, self.device)
        caches = HybridCaches(self.kv_caches, self.conv_states, self.recurrent_states)
        embeds, positions = self._multimodal(input_ids, meta, items)
        self._states_touched = True
        return self.model.forward(input_ids, meta, batch, caches, inputs_embeds=embeds, positions=positions)

    def _multimodal(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                    items: list[EngineItem]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Input embeddings with the media rows written in, and ``[3, T]`` MRoPE positions;
        ``(None, None)`` when every item is text (the text path, unchanged)."""
        if not any("mrope_positions" in item.inputs or item.request_id in self.rope_deltas for item in items):
            return None, None
        positions = meta.positions[None].repeat(3, 1)
        embeds = None
        bounds = meta.query_start_loc.tolist()
        for row, item in enumerate(items):
            lo, hi = bounds[row], bounds[row + 1]
            given = item.inputs.get("mrope_positions") if item.op == "prefill" else None
            if given is None:
                positions[:, lo:hi] += self.rope_deltas.get(item.request_id, 0)
                continue
            start = int(meta.positions[lo])
            given = given.to(positions.device)
            positions[:, lo:hi] = given[:, start:start + hi - lo]
            self.rope_deltas[item.request_id] = int(given.max()) + 1 - given.shape[1]
            vision = item.inputs.get("vision_embeds")
            if vision is None:
                continue
            if embeds is None:
                embeds = self.model.embed_input_ids(input_ids)
            mask = torch.isin(input_ids[lo:hi], self.media_token_ids)
            if int(mask.sum()) != vision.shape[0]:
                raise ValueError(f"request {item.request_id}: {int(mask.sum())} media tokens but "
                                 f"{vision.shape[0]} vision embeddings")
            embeds[lo:hi][mask] = vision.to(embeds.device, embeds.dtype)
        return embeds, positions

    def _slot(self, request_id: str) -> int:
        if request_id in self.lost:
            raise RuntimeError(f"request {request_id}: its recurrent state was lost when an earlier batch failed")
        if self.states.has(request_id):
            return self.states.slot(request_id)
        slot = self.states.allocate(request_id)
        for tensor in (*self.conv_states, *self.recurrent_states):
            tensor[slot].zero_()
        return slot

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.rope_deltas.pop(request_id, None)
        self.states.free(request_id)
        self.lost.discard(request_id)

    def stats(self) -> dict[str, float]:
        return super().stats() | {"state_slots_used": self.states.num_used,
                                  "state_slots_total": self.states.capacity}


def vision_fn(tower):
    """The vision node: the media of every item in one forward of ``tower``; each item
    gets back its own rows (``vision_embeds``), in its media's order."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = tower.patch_embed.proj.weight
        grids = [item.inputs["grid_thw"].reshape(-1, 3) for item in items]
        patches = torch.cat([item.inputs["pixel_values"] for item in items]).to(weight.device, weight.dtype)
        embeds = tower(patches, torch.cat(grids).tolist())
        sizes = [sum(tower.num_tokens(tuple(g)) for g in grid.tolist()) for grid in grids]
        return [{"vision_embeds": part} for part in embeds.split(sizes)]

    return run
