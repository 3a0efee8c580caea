"""The autoregressive engine of a hybrid model: paged KV for the attention layers plus one
recurrent-state slot per request for the DeltaNet layers (``HybridForward``).

A request gets its slot (zeroed) at its first step and gives it back in ``release``, which
the worker calls however the request ends; a failed first step releases it too (the engine
undoes fresh requests). A recurrent state, unlike the KV cache, cannot be written twice: if a
batch fails once its forward pass has begun, the requests whose states may have advanced are
marked lost, and any later step of theirs (the worker's item-by-item retry) fails with a
clear error instead of decoding from a corrupted state. For the same reason no step is ever
launched ahead (overlap scheduling), and decode steps do not replay CUDA graphs.

Nor is a sequence ever preempted when the KV pages run out (``preemptible = False``):
recomputing it from its tokens would need its recurrent state reset and, for a request with
media, the vision embeddings and MRoPE positions that only its prefill reads. Its requests
hold their prompt + ``max_tokens`` pages from admission instead (``Qwen3_5.kv_upfront``), so
the pool never runs out under it.

A prefill of a request with images or videos also reads ``vision_embeds`` (the vision
node's output, one row per media token, prompt order) and ``mrope_positions`` (``[3, L]``):
the embeddings replace those of the media tokens, the positions drive MRoPE, and the
request's later steps run at ``position + rope_delta``. Text-only requests take the
text path unchanged. ``vision_fn`` is the vision node: every media of a plan's requests in
one forward of the ViT tower. ``qwen3_5_engines`` builds both nodes from the knobs.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.config import DeploymentConfig
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.engine.forward import SlotForward
from mstar.layers.gated_deltanet import StateBatch
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.qwen3_5.config import Qwen3_5VisionConfig
from mstar.model.qwen3_5.knobs import Qwen3_5Knobs
from mstar.model.qwen3_5.modeling import HybridCaches


class HybridForward(SlotForward):
    """Qwen3.5's forward: the recurrent-state slots of its DeltaNet layers, and the media
    embeddings and MRoPE positions of its prefills. ``state_shapes`` are the per-slot shapes of
    one recurrent layer's ``conv`` window and ``recurrent`` state; ``num_state_layers`` such
    layers get ``[max_slots, *shape]`` tensors (the conv window in ``dtype``, the recurrent
    state in ``state_dtype``)."""

    # The recurrent state after a prefix is not kept with its pages, and a media placeholder's
    # K/V depend on the image, not its token id: no prefix caching.
    kv_from_tokens = False

    def __init__(self, model, *, num_state_layers: int, state_shapes: dict[str, tuple[int, ...]], max_slots: int,
                 dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device,
                 media_token_ids: tuple[int, ...] = ()) -> None:
        super().__init__(model, max_slots)
        self.device = device
        self.media_token_ids = torch.tensor(media_token_ids, dtype=torch.int64, device=device)
        self.rope_deltas: dict[str, int] = {}
        self.conv_states = [torch.zeros(max_slots, *state_shapes["conv"], dtype=dtype, device=device)
                            for _ in range(num_state_layers)]
        self.recurrent_states = [torch.zeros(max_slots, *state_shapes["recurrent"], dtype=state_dtype,
                                             device=device) for _ in range(num_state_layers)]

    def slot_tensors(self) -> list[torch.Tensor]:
        return [*self.conv_states, *self.recurrent_states]

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        slots = [self.slot(item.request_id) for item in items]
        embeds, positions = self._multimodal(input_ids, meta, items)
        return {"states": StateBatch.build(meta.query_start_loc.tolist(), slots, self.device),
                "embeds": embeds, "positions": positions}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        caches = HybridCaches(kv_caches, self.conv_states, self.recurrent_states)
        return self.model.forward(input_ids, meta, inputs["states"], caches, inputs_embeds=inputs["embeds"],
                                  positions=inputs["positions"])

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

    def release(self, request_id: str) -> None:
        self.rope_deltas.pop(request_id, None)
        super().release(request_id)


def hybrid_engine(model, layout: KVLayout, *, num_state_layers: int, state_shapes: dict[str, tuple[int, ...]],
                  max_slots: int, state_dtype: torch.dtype, media_token_ids: tuple[int, ...] = (),
                  device: torch.device, dtype: torch.dtype, **kwargs) -> AutoregressiveEngine:
    """The language-model node (``kwargs``: the engine's pool sizes and attention backend)."""
    forward = HybridForward(model, num_state_layers=num_state_layers, state_shapes=state_shapes, max_slots=max_slots,
                            dtype=dtype, state_dtype=state_dtype, device=device, media_token_ids=media_token_ids)
    return AutoregressiveEngine(model, layout, device=device, dtype=dtype, forward=forward, **kwargs)


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


def qwen3_5_engines(model, tower, vision_config: Qwen3_5VisionConfig | None, knobs: Qwen3_5Knobs,
                    config: DeploymentConfig, max_slots: int, device: torch.device) -> dict[str, Engine]:
    """``vision`` over ``tower`` and ``llm`` over ``model``, for those that are not None."""
    engines: dict[str, Engine] = {}
    if tower is not None:
        engines["vision"] = StatelessEngine(vision_fn(tower))
    if model is None:
        return engines
    dtype = config.torch_dtype()
    media_ids = () if vision_config is None else (vision_config.image_token_id, vision_config.video_token_id)
    kv = config.resources.kv_cache
    engines["llm"] = hybrid_engine(
        model, KVLayout(*model.cache_shape()),  # a tensor-parallel rank caches its KV heads
        num_state_layers=len(model.config.linear_layers), state_shapes=model.state_shapes(),
        max_slots=max_slots, state_dtype=state_dtype(model.config.mamba_ssm_dtype, config),
        media_token_ids=media_ids, num_pages=kv.max_num_pages, page_size=kv.page_size,
        max_seq_len=config.max_seq_len, device=device, dtype=dtype, attention_backend=knobs.attention_backend)
    return engines


def state_dtype(checkpoint_dtype: str | None, config: DeploymentConfig) -> torch.dtype:
    """``resources.gdn_state.state_dtype``; ``auto``: the checkpoint's ``mamba_ssm_dtype``,
    else float32."""
    pool = config.resources.gdn_state
    name = pool.state_dtype if pool is not None else "auto"
    if name == "auto":
        name = checkpoint_dtype or "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"mamba_ssm_dtype {name!r} is not a torch dtype")
    return dtype
