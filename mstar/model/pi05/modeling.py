"""Pi0.5: the policy as one module whose parameter names are the released checkpoint's keys.

A request's prefix is its camera images (SigLIP tokens) followed by its prompt tokens (the task
and the discretised state, tokenised by the front end); it runs once through PaliGemma's
language model into the paged KV cache. The action chunk then starts as noise at flow time 1
and takes ``num_steps`` Euler steps to time 0: each step embeds the noisy actions, runs the
action expert over them (attending to the prefix's cache), and projects the expert's output to
a velocity. Batching is flattening: a prefill or a denoise step of several requests is one
forward over their tokens, described by one ``PagedAttentionMetadata``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.pi05.config import Pi05Config
from mstar.model.pi05.gemma import ChunkKeys, GemmaExpert, GemmaLanguageModel
from mstar.model.pi05.vision import MultiModalProjector, SiglipVisionTower


class PaliGemmaModel(nn.Module):
    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.vision_tower = SiglipVisionTower(config.vision)
        self.multi_modal_projector = MultiModalProjector(config.vision.hidden_size, config.text.hidden_size)
        self.language_model = GemmaLanguageModel(config.text, config.vocab_size)


class PaliGemma(nn.Module):
    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.model = PaliGemmaModel(config)


class PaliGemmaWithExpert(nn.Module):
    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.paligemma = PaliGemma(config)
        self.gemma_expert = GemmaExpert(config.expert)


def step_metadata(pages: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int], page_size: int,
                  device: torch.device | str = "cpu") -> PagedAttentionMetadata:
    """The metadata of a step in which sequence ``b`` (its KV on ``pages[b]``) writes ``counts[b]``
    new tokens at positions ``starts[b] ...``."""
    positions, slots, qsl = [], [], [0]
    for table, start, count in zip(pages, starts, counts, strict=True):
        for pos in range(start, start + count):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
        qsl.append(qsl[-1] + count)
    seq_lens = [s + c for s, c in zip(starts, counts, strict=True)]
    width = max(len(t) for t in pages)
    table = [list(t) + [0] * (width - len(t)) for t in pages]

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PagedAttentionMetadata(
        positions=as_tensor(positions), slot_mapping=as_tensor(slots), query_start_loc=as_tensor(qsl),
        seq_lens=as_tensor(seq_lens), page_table=as_tensor(table), page_size=page_size,
        host_query_start_loc=tuple(qsl), host_seq_lens=tuple(seq_lens))


class Pi05Policy(nn.Module):
    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.config = config
        width = config.expert.hidden_size
        self.paligemma_with_expert = PaliGemmaWithExpert(config)
        self.action_in_proj = nn.Linear(config.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, config.max_action_dim)
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)

    @property
    def paligemma(self) -> PaliGemmaModel:
        return self.paligemma_with_expert.paligemma.model

    @property
    def language_model(self) -> GemmaLanguageModel:
        return self.paligemma.language_model

    # ----------------------------------------------------------------- prefix
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, 3, S, S]`` in [-1, 1] -> prefix tokens ``[N, tokens_per_image, hidden]``."""
        return self.paligemma.multi_modal_projector(self.paligemma.vision_tower(pixels))

    def embed_prefix(self, image_tokens: Sequence[torch.Tensor], token_ids: Sequence[torch.Tensor]) -> torch.Tensor:
        """The prefixes of a batch flattened ``[T, hidden]``: per request its images' tokens
        (``[n_images, tokens_per_image, hidden]``) then its embedded prompt ``token_ids [L]``."""
        lm = self.language_model
        texts = lm.embed(torch.cat(list(token_ids))).split([len(ids) for ids in token_ids])
        parts = []
        for images, text in zip(image_tokens, texts, strict=True):
            parts += [images.reshape(-1, images.shape[-1]).to(text.dtype), text]
        return torch.cat(parts)

    def prefill(self, embeds: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: PagedAttentionMetadata | ChunkKeys) -> torch.Tensor:
        """Run the prefixes into the cache; their final hidden states ``[T, hidden]``."""
        return self.language_model(embeds, meta.positions, kv_caches, meta)

    # ----------------------------------------------------------------- actions
    def time_embedding(self, time: torch.Tensor) -> torch.Tensor:
        """Flow times ``[B]`` -> the expert's conditioning ``[B, width]`` (sin/cos over periods
        from ``min_period`` to ``max_period``, then a two-layer SiLU MLP)."""
        width = self.config.expert.hidden_size
        fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float32, device=time.device)
        period = self.config.min_period * (self.config.max_period / self.config.min_period) ** fraction
        angles = (1.0 / period * 2 * math.pi)[None, :] * time.float()[:, None]
        sinusoid = torch.cat([angles.sin(), angles.cos()], dim=1).to(self.time_mlp_in.weight.dtype)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(sinusoid))))

    def velocity(self, noisy: torch.Tensor, time: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: PagedAttentionMetadata | ChunkKeys) -> torch.Tensor:
        """One flow step's velocity ``[B, chunk, max_action_dim]`` for noisy actions ``[B, chunk,
        max_action_dim]`` at times ``[B]``; ``meta`` writes each chunk after its prefix (the
        paged metadata, or ``ChunkKeys``: the engine's fixed-shape form of the same step)."""
        batch, chunk, _ = noisy.shape
        embeds = self.action_in_proj(noisy.to(self.action_in_proj.weight.dtype)).reshape(batch * chunk, -1)
        cond = self.time_embedding(time)
        hidden = self.paligemma_with_expert.gemma_expert.model(embeds, cond, meta.positions, kv_caches, meta)
        return self.action_out_proj(hidden).view(batch, chunk, -1).float()

    @torch.no_grad()
    def sample_actions(self, pixels: Sequence[torch.Tensor], token_ids: Sequence[torch.Tensor], noise: torch.Tensor,
                       num_steps: int | None = None, page_size: int = 16) -> torch.Tensor:
        """The eager reference of the whole policy for a batch: images ``[n_b, 3, S, S]`` and
        prompt ids ``[L_b]`` per request, ``noise [B, chunk, max_action_dim]`` -> the denoised
        chunks (normalised action space, padded to ``max_action_dim``). A cache of its own."""
        steps = num_steps or self.config.num_inference_steps
        weight = self.action_in_proj.weight
        lengths = [len(p) * self.config.tokens_per_image + len(ids) for p, ids in zip(pixels, token_ids, strict=True)]
        chunk = noise.shape[1]
        pages, next_page = [], 0
        for length in lengths:
            count = -(-(length + chunk) // page_size)
            pages.append(list(range(next_page, next_page + count)))
            next_page += count
        dims = self.config.text
        caches = allocate_kv_cache(dims.num_layers, next_page, page_size, dims.num_kv_heads, dims.head_dim,
                                   weight.dtype, weight.device)
        images = [self.encode_images(p) if len(p) else p.new_zeros(0, 1, dims.hidden_size) for p in pixels]
        self.prefill(self.embed_prefix(images, token_ids), caches,
                     step_metadata(pages, [0] * len(lengths), lengths, page_size, weight.device))
        meta = step_metadata(pages, lengths, [chunk] * len(lengths), page_size, weight.device)
        x = noise.float()
        dt = -1.0 / steps
        for step in range(steps):
            time = torch.full((len(lengths),), 1.0 + step * dt, dtype=torch.float32, device=weight.device)
            x = x + dt * self.velocity(x, time, caches, meta)
        return x
