"""The autoregressive engine of Nemotron-H: paged KV for the attention layers plus one
recurrent-state slot per request for the Mamba-2 layers (``MambaForward``).

A request gets its slot (zeroed) at its first step and gives it back in ``release``, which
the worker calls however the request ends (finished, failed or cancelled); a failed first
step releases it too. A recurrent state cannot be recomputed from the KV pages or written
twice, so: a batch that fails once its forward began marks its requests' states lost (a
later step of theirs fails with a clear error), no step runs ahead (overlap scheduling), and
no sequence is preempted (its requests hold their pages from admission, ``kv_upfront``).

A step's input embeddings may come from outside: an item that carries ``input_embeds``
(``[its new tokens, hidden]``) has them replace its token lookup, the seam through which the
duplex model feeds a fused audio frame.

A step of one token per sequence (every decode, and a one-token first step) takes its inputs
in the *row form*: each row's state slot (``[B]`` int64 on the device) and its input
embedding (``[B, hidden]``: the given ``input_embeds``, else the token's lookup, made before
the forward). That is what the engine's decode graphs (``cuda_graphs``) take as static per-row
inputs (``graph_rows``): a padded row reads and writes the pool's sink slot from a zero
embedding, and its K/V go to the scratch page. Inside, every Mamba layer gathers and scatters
its conv window and SSM state by those slot indices, with no host read. The graph replays the
same step in place: a row's state advances exactly once, as eagerly, and a failed replay marks
its rows lost the same way, so the rules above stand. Steps with a longer sequence (a prompt)
run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.forward import SlotForward
from mstar.layers.gated_deltanet import StateBatch
from mstar.layers.paged_kv import PagedAttentionMetadata, to_device
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
        self.graph_rows = {"slots": self.states.sink,
                           "embeds": torch.zeros(model.config.hidden_size, dtype=dtype, device=device)}

    def slot_tensors(self) -> list[torch.Tensor]:
        return [*self.conv_states, *self.ssm_states]

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        bounds = meta.query_starts  # the host copy the engine built: no read of the device tensor
        embeds = self._embeds(items, input_ids, bounds, rows=counts is None)  # checked before a slot is taken
        slots = [self.slot(item.request_id) for item in items]
        if counts is None:  # the row form (the module's docstring), which a decode graph replays
            return {"slots": to_device(torch.tensor(slots, dtype=torch.int64), self.device), "embeds": embeds}
        return {"states": StateBatch.build(bounds, slots, self.device), "embeds": embeds}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        caches = NemotronHCaches(kv_caches, self.conv_states, self.ssm_states)
        states = inputs["states"] if "states" in inputs else StateBatch.decodes(inputs["slots"])
        return self.model.forward(input_ids, meta, states, caches, inputs_embeds=inputs["embeds"])

    def _embeds(self, items: list[EngineItem], input_ids: torch.Tensor, bounds: list[int],
                rows: bool) -> torch.Tensor | None:
        """The token embeddings with the rows of items carrying ``input_embeds`` replaced;
        None when no item does (the plain lookup, inside the forward) unless ``rows`` (the row
        form: always a tensor)."""
        given = [item.inputs.get("input_embeds") for item in items]
        width = self.model.config.hidden_size
        for item, embed, lo, hi in zip(items, given, bounds, bounds[1:]):
            if embed is not None and embed.shape != (hi - lo, width):
                raise ValueError(f"request {item.request_id}: input_embeds {tuple(embed.shape)} for "
                                 f"{hi - lo} new tokens of width {width}")
        if all(embed is None for embed in given):
            return self.model.embed_input_ids(input_ids) if rows else None
        dtype = self.model.backbone.embeddings.weight.dtype
        if all(embed is not None for embed in given):  # the duplex model's every step: one copy
            return torch.cat([embed.to(self.device) for embed in given]).to(dtype)
        embeds = self.model.embed_input_ids(input_ids)
        for embed, lo, hi in zip(given, bounds, bounds[1:]):
            if embed is not None:
                embeds[lo:hi] = embed.to(embeds.device, embeds.dtype)
        return embeds


def nemotron_h_engine(model: NemotronHForCausalLM, *, max_slots: int, state_dtype: torch.dtype,
                      device: torch.device, dtype: torch.dtype, **kwargs) -> AutoregressiveEngine:
    """The language-model node (``kwargs``: the engine's pool sizes and attention backend)."""
    forward = MambaForward(model, max_slots=max_slots, dtype=dtype, state_dtype=state_dtype, device=device)
    return AutoregressiveEngine(model, KVLayout(*model.cache_shape()), device=device, dtype=dtype,
                                forward=forward, **kwargs)
