"""BAGEL's engines for understanding: the vision node (stateless: every image of a plan's
requests in one tower forward) and the language model on the autoregressive engine, whose
forward side (``BagelForward``) knows BAGEL's positions.

A prefill with images reads, besides its ``prompt_ids``, the vision node's
``vision_embeds`` (one row per patch, prompt order), ``vision_rows`` (where they go),
``rope_positions`` and ``mask_positions`` (``mstar.model.bagel.prompt``). The engine's
metadata gives each new token its cache index; the forward swaps in the mask positions for
the attention and the rope positions for RoPE. A request's decodes then run at rope position
``cache index + offset``, the offset fixed by its prompt (an image advances the rope
position by one for all its tokens). A text-only prompt is laid out with rope = cache
positions and needs none of this.

An image's tokens attend to each other both ways, so a prefill is never split into chunks:
the forward refuses a chunk that would cut an image; sequences are not preempted (their
vision embeddings are read by the prefill only), so their pages are held from admission
(``kv_upfront``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mstar.config import DeploymentConfig
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.engine.forward import Forward
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.bagel.knobs import BagelKnobs
from mstar.model.bagel.llm import BagelLanguageModel
from mstar.model.bagel.vision import BagelVision


class BagelForward(Forward):
    runs_ahead = False
    kv_from_tokens = False  # an image's K/V depend on its pixels
    preemptible = False

    def __init__(self, model: BagelLanguageModel) -> None:
        super().__init__(model)
        self.graph_rows = None
        self.rope_offsets: dict[str, int] = {}

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        cache_positions = meta.positions
        rope, mask = cache_positions.clone(), cache_positions.clone()
        embeds = self.model.embed(input_ids)
        bounds = meta.query_starts
        for row, item in enumerate(items):
            lo, hi = bounds[row], bounds[row + 1]
            given = item.inputs.get("rope_positions") if item.op == "prefill" else None
            if given is None:
                rope[lo:hi] += self.rope_offsets.get(item.request_id, 0)
                continue
            start, end = int(cache_positions[lo]), int(cache_positions[lo]) + hi - lo
            item_mask = item.inputs["mask_positions"]
            if int(item_mask[start:end].max()) >= end:
                raise ValueError(f"request {item.request_id}: a prefill chunk would cut an image")
            rope[lo:hi] = given[start:end].to(rope.device)
            mask[lo:hi] = item_mask[start:end].to(mask.device)
            self.rope_offsets[item.request_id] = int(given[-1]) - (given.shape[0] - 1)
            vision = item.inputs.get("vision_embeds")
            if vision is not None:
                rows = item.inputs["vision_rows"]
                before = int(rows[:start].sum())
                here = rows[start:end].to(embeds.device)
                taken = int(here.sum())
                embeds[lo:hi][here] = vision[before:before + taken].to(embeds.device, embeds.dtype)
        return {"embeds": embeds, "rope": rope, "meta": dataclasses.replace(meta, positions=mask)}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        return self.model(inputs["embeds"], inputs["rope"], kv_caches, inputs["meta"])

    def release(self, request_id: str) -> None:
        self.rope_offsets.pop(request_id, None)


def vision_fn(tower: BagelVision):
    """The vision node: the images of every item in one forward; each item gets back its own
    rows (``vision_embeds``)."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = tower.connector.fc1.weight
        counts = [item.inputs["patch_counts"].tolist() for item in items]
        patches = torch.cat([item.inputs["patches"] for item in items]).to(weight.device, weight.dtype)
        positions = torch.cat([item.inputs["patch_positions"] for item in items]).to(weight.device)
        embeds = tower(patches, positions, [n for per_item in counts for n in per_item])
        return [{"vision_embeds": part} for part in embeds.split([sum(c) for c in counts])]

    return run


def bagel_engines(model: BagelLanguageModel | None, tower: BagelVision | None, knobs: BagelKnobs,
                  config: DeploymentConfig, device: torch.device) -> dict[str, Engine]:
    """``vision`` over ``tower`` and ``llm`` over ``model``, for those that are not None."""
    engines: dict[str, Engine] = {}
    if tower is not None:
        engines["vision"] = StatelessEngine(vision_fn(tower))
    if model is not None:
        kv = config.resources.kv_cache
        engines["llm"] = AutoregressiveEngine(
            model, KVLayout(*model.cache_shape()), num_pages=kv.max_num_pages, page_size=kv.page_size,
            max_seq_len=config.max_seq_len, device=device, dtype=config.torch_dtype(),
            forward=BagelForward(model), attention_backend=knobs.attention_backend)
    return engines
