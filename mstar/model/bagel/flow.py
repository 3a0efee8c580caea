"""BAGEL's image generation over the paged KV cache: building the context caches, and the
flow-matching loop whose every step attends to them.

A request's context lives in one paged sequence per CFG variant (``KVContext``): the full
context, the context without the text (text guidance), and the context without the input
images (image guidance). Each is built by appending segments, as BAGEL's inferencer does:

- text: ``<|im_start|> ids <|im_end|>``, causal, one rope position per token;
- an image as VAE latents (editing): ``<|vision_start|> latents <|vision_end|>``, the latent
  tokens ``vae2llm(z) + time_embedder(0) + latent_pos_embed`` through the generation weights;
- an image as ViT tokens: ``<|vision_start|> vit <|vision_end|>``, understanding weights.

An image's tokens attend to each other both ways and share one rope position. A flow step
queries each variant with ``<|vision_start|> x_t <|vision_end|>`` at the context's next rope
position; its keys and values go to scratch slots just past the context (the sequence's
pages must cover them) and are never committed, so the context stays as built. Every
variant of every request in a step runs in one forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.bagel.generation import CfgOptions, LatentProjections, cfg_active, cfg_combine, timestep_schedule
from mstar.model.bagel.prompt import SpecialTokens

__all__ = ["FlowQuery", "ImageContexts", "KVContext", "Segment", "extend", "flow_velocities",
           "generate_latents", "guided_velocity", "image_segment", "latent_segment", "step_metadata", "step_queries",
           "text_segment"]


class MoTLanguageModel(Protocol):
    """What the flow needs of BAGEL's language model (``mstar.model.bagel.llm``)."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def parameters(self): ...

    def cache_shape(self) -> tuple[int, int, int]: ...

    def __call__(self, embeds: torch.Tensor, rope_positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: PagedAttentionMetadata, generation: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class KVContext:
    """One paged sequence: its pages, the tokens cached in them, its next rope position."""

    pages: list[int]
    length: int = 0
    rope: int = 0


@dataclass(frozen=True)
class Segment:
    """Tokens to append to a context: their input embeddings ``[L, hidden]``, whether they
    attend causally (text) or both ways (an image), which take the generation weights, and
    how many rope positions they take (``L`` for text, 1 for an image)."""

    embeds: torch.Tensor
    causal: bool
    generation: torch.Tensor | None
    rope_span: int

    def rope_positions(self, start: int) -> torch.Tensor:
        n = self.embeds.shape[0]
        return torch.arange(start, start + n) if self.causal else torch.full((n,), start)


def text_segment(llm: MoTLanguageModel, ids: Sequence[int], tokens: SpecialTokens) -> Segment:
    """``<|im_start|> ids <|im_end|>``, causal."""
    wrapped = torch.tensor([tokens.im_start, *ids, tokens.im_end], dtype=torch.long)
    return Segment(_embed(llm, wrapped), causal=True, generation=None, rope_span=len(wrapped))


def image_segment(llm: MoTLanguageModel, inner: torch.Tensor, tokens: SpecialTokens, generation: bool) -> Segment:
    """``<|vision_start|> inner <|vision_end|>``: ``inner`` ``[N, hidden]`` (ViT tokens through
    the connector, or latent tokens, which take the generation weights), both ways, one rope
    position."""
    marks = _embed(llm, torch.tensor([tokens.vision_start, tokens.vision_end]))
    embeds = torch.cat([marks[:1], inner.to(marks.dtype), marks[1:]])
    mask = None
    if generation:
        mask = torch.zeros(embeds.shape[0], dtype=torch.bool)
        mask[1:-1] = True
    return Segment(embeds, causal=False, generation=mask, rope_span=1)


def _embed(llm: MoTLanguageModel, ids: torch.Tensor) -> torch.Tensor:
    return llm.embed(ids.to(next(llm.parameters()).device))


def latent_segment(llm: MoTLanguageModel, proj: LatentProjections, x: torch.Tensor, t: float,
                   position_ids: torch.Tensor, tokens: SpecialTokens) -> Segment:
    """Latent tokens ``x`` ``[N, 4C]`` at flow time ``t`` (0: a clean image) as an image segment."""
    weight = proj.vae2llm.weight
    times = torch.full((x.shape[0],), float(t), device=weight.device)
    inner = proj.embed(x.to(weight.device, weight.dtype), times, position_ids.to(weight.device))
    return image_segment(llm, inner, tokens, generation=True)


def step_metadata(rows: Sequence[tuple[KVContext, Segment]], page_size: int,
                  device: torch.device | None = None, backend: str = "torch") -> PagedAttentionMetadata:
    """The metadata of one forward appending each segment at its context's end. A causal
    segment's tokens see the cache up to themselves, an image's up to its last token: every
    backend's rule (a query sees the keys at or below its mask position), so ``backend``
    (``"torch"`` or ``"triton"``, ``mstar.layers.attention``) runs images both ways as well."""
    positions, slots, starts, seq_lens = [], [], [0], []
    for ctx, seg in rows:
        n = seg.embeds.shape[0]
        end = ctx.length + n
        if end > len(ctx.pages) * page_size:
            raise ValueError(f"a context of {ctx.length} tokens has {len(ctx.pages)} pages of {page_size}: "
                             f"too few for {n} more")
        index = torch.arange(ctx.length, end)
        positions.append(index if seg.causal else torch.full((n,), end - 1))
        pages = torch.tensor(ctx.pages, dtype=torch.long)
        slots.append(pages[index // page_size] * page_size + index % page_size)
        starts.append(starts[-1] + n)
        seq_lens.append(end)
    width = max(len(ctx.pages) for ctx, _ in rows)
    table = torch.tensor([ctx.pages + [0] * (width - len(ctx.pages)) for ctx, _ in rows], dtype=torch.long)
    meta = PagedAttentionMetadata(
        positions=torch.cat(positions), slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens), page_table=table, page_size=page_size,
        host_query_start_loc=tuple(starts), host_seq_lens=tuple(seq_lens), backend=backend)
    if device is None or device.type == "cpu":
        return meta
    return PagedAttentionMetadata(
        positions=meta.positions.to(device), slot_mapping=meta.slot_mapping.to(device),
        query_start_loc=meta.query_start_loc.to(device), seq_lens=meta.seq_lens.to(device),
        page_table=meta.page_table.to(device), page_size=page_size, host_query_start_loc=tuple(starts),
        host_seq_lens=tuple(seq_lens), backend=backend)


def _forward(llm: MoTLanguageModel, kv_caches: list[torch.Tensor], page_size: int,
             rows: Sequence[tuple[KVContext, Segment]], backend: str) -> torch.Tensor:
    device = kv_caches[0].device
    embeds = torch.cat([seg.embeds for _, seg in rows]).to(device)
    rope = torch.cat([seg.rope_positions(ctx.rope) for ctx, seg in rows]).to(device)
    generation = None
    if any(seg.generation is not None for _, seg in rows):
        generation = torch.cat([seg.generation if seg.generation is not None
                                else torch.zeros(seg.embeds.shape[0], dtype=torch.bool) for _, seg in rows])
    return llm(embeds, rope, kv_caches, step_metadata(rows, page_size, device, backend), generation)


@torch.no_grad()
def extend(llm: MoTLanguageModel, kv_caches: list[torch.Tensor], page_size: int,
           rows: Sequence[tuple[KVContext, Segment]], backend: str = "torch") -> None:
    """Append each segment to its context (one forward for all, attention by ``backend``): the
    keys and values are cached, and the contexts advance."""
    _forward(llm, kv_caches, page_size, rows, backend)
    for ctx, seg in rows:
        ctx.length += seg.embeds.shape[0]
        ctx.rope += seg.rope_span


@dataclass(frozen=True)
class FlowQuery:
    """One velocity to evaluate: latent tokens ``x`` ``[N, 4C]`` at time ``t`` against ``context``."""

    context: KVContext
    x: torch.Tensor
    t: float
    position_ids: torch.Tensor


@torch.no_grad()
def flow_velocities(llm: MoTLanguageModel, proj: LatentProjections, kv_caches: list[torch.Tensor], page_size: int,
                    queries: Sequence[FlowQuery], tokens: SpecialTokens, backend: str = "torch") -> list[torch.Tensor]:
    """The velocity ``[N, 4C]`` (float32) of each query, all in one forward (attention by
    ``backend``); the contexts are left as they were (the queries' keys and values sit in
    scratch slots past them)."""
    rows = [(q.context, latent_segment(llm, proj, q.x, q.t, q.position_ids, tokens)) for q in queries]
    hidden = _forward(llm, kv_caches, page_size, rows, backend)
    out, start = [], 0
    for _, seg in rows:
        n = seg.embeds.shape[0]
        out.append(proj.velocity(hidden[start + 1: start + n - 1]).float())
        start += n
    return out


@dataclass
class ImageContexts:
    """A generation's three contexts. ``no_text`` serves text guidance; ``no_image`` image
    guidance, ``None`` when it would equal ``full`` (nothing to drop: its velocity is ``full``'s)."""

    full: KVContext
    no_text: KVContext
    no_image: KVContext | None = None


def step_queries(contexts: ImageContexts, x: torch.Tensor, t: float, position_ids: torch.Tensor,
                 cfg: CfgOptions | None) -> list[FlowQuery]:
    """The velocities one step of one image needs: the full context's, and inside the guidance
    interval the text-dropped one's and (image guidance, when there is an image to drop) the
    image-dropped one's."""
    variants = [contexts.full]
    if cfg is not None and cfg_active(t, cfg.interval) and cfg.text_scale > 1.0:
        variants.append(contexts.no_text)
        if cfg.img_scale > 1.0 and contexts.no_image is not None:
            variants.append(contexts.no_image)
    return [FlowQuery(c, x, t, position_ids) for c in variants]


def guided_velocity(v: Sequence[torch.Tensor], cfg: CfgOptions | None) -> torch.Tensor:
    """The step's velocity from those of ``step_queries`` (in its order)."""
    if len(v) == 1:
        return v[0]
    assert cfg is not None
    v_img = v[2] if len(v) > 2 else v[0]  # no image to drop: the image-dropped context is the full one
    return cfg_combine(v[0], v[1], v_img, cfg.text_scale, cfg.img_scale, cfg.renorm_type, cfg.renorm_min)


def generate_latents(llm: MoTLanguageModel, proj: LatentProjections, kv_caches: list[torch.Tensor], page_size: int,
                     contexts: ImageContexts, noise: torch.Tensor, position_ids: torch.Tensor, tokens: SpecialTokens,
                     num_timesteps: int = 50, shift: float = 3.0, cfg: CfgOptions | None = None,
                     backend: str = "torch") -> torch.Tensor:
    """One image's latent tokens ``[N, 4C]``: Euler steps from ``noise`` over the shifted
    schedule, guided by ``cfg`` (``None``: unguided) inside its interval, attention by ``backend``."""
    x = noise.float()
    for t, dt in zip(*timestep_schedule(num_timesteps, shift)):
        queries = step_queries(contexts, x, float(t), position_ids, cfg)
        v = flow_velocities(llm, proj, kv_caches, page_size, queries, tokens, backend)
        x = x - guided_velocity(v, cfg) * dt
    return x
