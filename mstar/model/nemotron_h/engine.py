"""The autoregressive engine of Nemotron-H: paged KV for the attention layers plus one
recurrent-state slot per request for the Mamba-2 layers (``MambaForward``).

A request gets its slot (zeroed) at its first step and gives it back in ``release``, which
the worker calls however the request ends (finished, failed or cancelled); a failed first
step releases it too. A recurrent state cannot be recomputed from the KV pages or written
twice, so: a batch that fails once its forward began marks its requests' states lost (a
later step of theirs fails with a clear error), no step runs ahead (overlap scheduling), no
decode replays a CUDA graph, and no sequence is preempted (its requests hold their pages
from admission, ``kv_upfront``).

A step's input embeddings may come from outside: an item that carries ``input_embeds``
(``[its new tokens, hidden]``) has them replace its token lookup, the seam through which the
duplex model will feed a fused audio frame.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.forward import SlotForward
from mstar.layers.gated_deltanet import StateBatch
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.nemotron_h.modeling import NemotronHCaches, NemotronHForCausalLM


class MambaForward(SlotForward):
    """Nemotron-H's forward: the conv-window and SSM-state slots of its Mamba layers
    (``[max_slots, *shape]`` per layer: the window in ``dtype``, the state in
    ``state_dtype``), handed out by a ``StatePool`` of ``max_slots`` (one the sink)."""

    kv_from_tokens = False  # the recurrent state after a prefix is not kept with its pages

    def __init__(self, model: NemotronHForCausalLM, *, max_slots: int, dtype: torch.dtype,
                 state_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(model, max_slots)
        self.device = device
        shapes = model.state_shapes()
        layers = len(model.config.mamba_layers)
        self.conv_states = [torch.zeros(max_slots, *shapes["conv"], dtype=dtype, device=device)
                            for _ in range(layers)]
        self.ssm_states = [torch.zeros(max_slots, *shapes["ssm"], dtype=state_dtype, device=device)
                           for _ in range(layers)]

    def slot_tensors(self) -> list[torch.Tensor]:
        return [*self.conv_states, *self.ssm_states]

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        slots = [self.slot(item.request_id) for item in items]
        bounds = meta.query_starts  # the host copy the engine built: no read of the device tensor
        return {"states": StateBatch.build(bounds, slots, self.device),
                "embeds": self._embeds(items, input_ids, bounds)}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        caches = NemotronHCaches(kv_caches, self.conv_states, self.ssm_states)
        return self.model.forward(input_ids, meta, inputs["states"], caches, inputs_embeds=inputs["embeds"])

    def _embeds(self, items: list[EngineItem], input_ids: torch.Tensor, bounds: list[int]) -> torch.Tensor | None:
        """The token embeddings with the rows of items carrying ``input_embeds`` replaced;
        None when no item does (the plain lookup)."""
        if not any("input_embeds" in item.inputs for item in items):
            return None
        embeds = self.model.embed_input_ids(input_ids)
        for row, item in enumerate(items):
            given = item.inputs.get("input_embeds")
            if given is None:
                continue
            lo, hi = bounds[row], bounds[row + 1]
            if given.shape != (hi - lo, embeds.shape[1]):
                raise ValueError(f"request {item.request_id}: input_embeds {tuple(given.shape)} for "
                                 f"{hi - lo} new tokens of width {embeds.shape[1]}")
            embeds[lo:hi] = given.to(embeds.device, embeds.dtype)
        return embeds


def nemotron_h_engine(model: NemotronHForCausalLM, *, max_slots: int, state_dtype: torch.dtype,
                      device: torch.device, dtype: torch.dtype, **kwargs) -> AutoregressiveEngine:
    """The language-model node (``kwargs``: the engine's pool sizes and attention backend)."""
    forward = MambaForward(model, max_slots=max_slots, dtype=dtype, state_dtype=state_dtype, device=device)
    return AutoregressiveEngine(model, KVLayout(*model.cache_shape()), device=device, dtype=dtype,
                                forward=forward, **kwargs)
