"""Command A+'s engine: the shared autoregressive engine over its decoder, whose prefills
may carry an image's tiles (``pixel_values``).

``ImageForward`` encodes those tiles (the vision tower and projector, on the decoder's first
TP rank, which broadcasts the tokens to the others) into the rows of the prompt's image
placeholders, then runs the decoder on the embeddings; a text-only step is the plain forward.
An image placeholder's K/V depend on the image, not its id, so no prefix caching, and a
sequence is never preempted (its recompute would read the ids alone): requests hold their
prompt + ``max_tokens`` pages from admission (``CommandAPlusChat.kv_upfront``). The
sliding-window layers keep their own pool, giving back the pages their window has passed
(``mstar.engine.window_pages``)."""

from __future__ import annotations

from typing import Any

import torch

from mstar.config import DeploymentConfig
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.engine.forward import Forward
from mstar.layers.moe import use_moe_kernel
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.command_a_plus.knobs import CommandAPlusKnobs
from mstar.model.command_a_plus.modeling import CommandAPlusForCausalLM


class ImageForward(Forward):
    kv_from_tokens = False  # an image placeholder's K/V are the image's
    preemptible = False  # a recompute from the ids alone would lose the image

    def __init__(self, model: CommandAPlusForCausalLM) -> None:
        super().__init__(model)
        self.graph_rows = None

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        if not any(item.op == "prefill" and "pixel_values" in item.inputs for item in items):
            return {}
        embeds = self.model.embed_input_ids(input_ids)
        bounds = meta.query_starts
        for row, item in enumerate(items):
            pixels = item.inputs.get("pixel_values") if item.op == "prefill" else None
            if pixels is not None:
                lo, hi = bounds[row], bounds[row + 1]
                embeds[lo:hi] = self.model.embed_with_images(input_ids[lo:hi], pixels.to(input_ids.device))
        return {"embeds": embeds}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        embeds = inputs.get("embeds")
        return self.model.forward(None if embeds is not None else input_ids, meta, kv_caches, inputs_embeds=embeds)


def command_engine(model: CommandAPlusForCausalLM, knobs: CommandAPlusKnobs, config: DeploymentConfig,
                   device: torch.device) -> AutoregressiveEngine:
    """The ``llm`` node's engine: the KV pool from ``resources.kv_cache`` (the sliding-window
    layers' own pool as large: a smaller one would need prefills deferred when it runs short,
    which a forward that cannot preempt does not do yet), the experts on ``moe_kernel``."""
    use_moe_kernel(model, knobs.moe_kernel)
    kv = config.resources.kv_cache
    layout = KVLayout(*model.cache_shape(), windows=model.kv_windows())
    return AutoregressiveEngine(model, layout, num_pages=kv.max_num_pages, page_size=kv.page_size,
                                max_seq_len=config.max_seq_len, device=device, dtype=config.torch_dtype(),
                                forward=ImageForward(model))
