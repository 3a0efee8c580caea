"""Fish S2-Pro's dual AR: the slow AR (a Qwen3 decoder on the paged KV cache) and the fast
AR (a small decoder over one frame's codebooks).

One slow step makes one audio frame of ``N = num_codebooks`` codes:

* the **slow AR** reads one row per token. A text token is its ``embeddings`` row; a
  semantic token ``<|semantic:c0|>`` (an audio frame, in the prompt or fed back) is its
  ``embeddings`` row plus ``codebook_embeddings[i * codebook_size + c_i]`` summed over the
  frame's codes ``c_0 .. c_{N-1}`` (divided by ``sqrt(N + 1)`` with
  ``scale_codebook_embeddings``). Its final-normed state, through the output head (the
  embeddings, tied), gives the logits of the next token: a semantic token (codebook 0 is its
  offset from ``<|semantic:0|>``) or ``<|im_end|>``.
* the **fast AR** then runs that frame alone: row 0 is the slow AR's last hidden state,
  final-normed with ``norm_fastlayer_input`` (S2) and before the final norm otherwise
  (fish-speech 0.1.0's S1 models), through ``fast_project_in`` when the widths differ; row ``i`` the
  ``fast_embeddings`` of code ``i - 1``; row ``i``'s ``fast_output`` logits give code ``i``.
  Its KV lives for the frame only: a fresh page of ``N`` slots per request.

RoPE: fish-speech rotates channel pairs ``(2j, 2j + 1)`` (interleaved); these modules use
the project's half-split layout, so the checkpoint loader permutes the rows of the query and
key projections (and the q/k norm weights) once (``interleaved_to_half``), which makes the
two layouts compute the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.layers.rotary import RotaryEmbedding
from mstar.model.fish_s2_pro.config import DualARConfig
from mstar.model.fish_s2_pro.paging import step_metadata
from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.modeling import LlamaDecoderLayer, LlamaModel, kv_cache_shape
from mstar.model.qwen3.causal import Qwen3PagedDecoderLayer

Sampler = Callable[[torch.Tensor, int], torch.Tensor]
"""``sampler(logits [B, codebook_size], codebook) -> codes [B]`` for codebooks 1 .. N - 1;
``None`` is greedy (argmax)."""


def _layers(config: LlamaConfig, qk_norm: bool, count: int) -> nn.ModuleList:
    layer = Qwen3PagedDecoderLayer if qk_norm else LlamaDecoderLayer
    return nn.ModuleList(layer(config) for _ in range(count))


class SlowAR(LlamaModel):
    """The slow AR: text and codebook embeddings, Qwen3 layers, final norm, tied head."""

    def __init__(self, config: DualARConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        base = config.slow_llama()
        self.embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.codebook_embeddings = nn.Embedding(config.codebook_size * config.num_codebooks, config.dim)
        self.layers = _layers(base, config.attention_qk_norm, config.n_layer)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_base)
        self.output = None if config.tie_word_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Input rows ``[T, dim]`` of ``tokens [T]`` and their frames ``codes [T, N]`` (read
        only where the token is a semantic token)."""
        c = self.config
        x = self.embeddings(tokens)
        semantic = (tokens >= c.semantic_begin_id) & (tokens <= c.semantic_end_id)
        offsets = torch.arange(c.num_codebooks, device=codes.device) * c.codebook_size
        frames = self.codebook_embeddings(codes.clamp(0, c.codebook_size - 1) + offsets).sum(dim=1)
        x = x + frames * semantic[:, None]
        if c.scale_codebook_embeddings:
            x = torch.where(semantic[:, None], x / math.sqrt(c.num_codebooks + 1), x)
        return x

    def forward(self, tokens: torch.Tensor, codes: torch.Tensor, meta: PagedAttentionMetadata,  # type: ignore[override]
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, fast_input)``, each ``[T, dim]``: the final-normed states (for the logits)
        and the fast AR's input rows (the normed states with ``norm_fastlayer_input``, else
        the states before the final norm)."""
        x = self.embed(tokens, codes)
        cos_sin = self.rotary_emb.cos_sin(meta.positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, meta, kv_cache)
        normed, hidden = (self.norm(x), x) if residual is None else self.norm(x, residual)
        return normed, normed if self.config.norm_fastlayer_input else hidden

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        weight = self.embeddings.weight if self.output is None else self.output.weight
        return normed @ weight.t()


@dataclass
class Frame:
    """One slow step's audio frame for ``B`` requests."""

    codes: torch.Tensor  # [B, N]: codebook 0 (from the slow token) then the fast AR's 1 .. N - 1


class FastAR(nn.Module):
    """The fast AR over one frame's codebooks."""

    def __init__(self, config: DualARConfig) -> None:
        super().__init__()
        self.config = config
        base = config.fast_llama()
        self.fast_project_in = nn.Linear(config.dim, config.fast_dim) if config.fast_dim != config.dim else None
        self.fast_embeddings = nn.Embedding(config.codebook_size, config.fast_dim)
        self.fast_layers = _layers(base, bool(config.fast_attention_qk_norm), config.n_fast_layer)
        self.fast_norm = RMSNorm(config.fast_dim, config.norm_eps)
        self.fast_output = nn.Linear(config.fast_dim, config.codebook_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.fast_head_dim, config.rope_base)
        self.kv_shape = kv_cache_shape(base)

    def _run(self, x: torch.Tensor, meta: PagedAttentionMetadata, caches: list[torch.Tensor]) -> torch.Tensor:
        cos_sin = self.rotary_emb.cos_sin(meta.positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.fast_layers, caches, strict=True):
            x, residual = layer(x, residual, cos_sin, meta, kv_cache)
        return self.fast_norm(x) if residual is None else self.fast_norm(x, residual)[0]

    def forward(self, hidden: torch.Tensor, code0: torch.Tensor, sampler: Sampler | None = None,
                on_logits: Callable[[int, torch.Tensor], None] | None = None) -> Frame:
        """The frame of ``B`` requests from the slow AR's ``fast_input`` rows ``hidden [B, dim]`` and
        ``code0 [B]``; ``on_logits(codebook, logits)`` sees each step's logits (tests)."""
        c = self.config
        batch, n = hidden.shape[0], c.num_codebooks
        if self.fast_project_in is not None:
            hidden = self.fast_project_in(hidden)
        layers, heads, head_dim = self.kv_shape
        caches = allocate_kv_cache(layers, batch, n, heads, head_dim, hidden.dtype, hidden.device)
        prompt = torch.stack((hidden, self.fast_embeddings(code0)), dim=1).reshape(2 * batch, -1)
        pages = [[b] for b in range(batch)]  # request b: page b of n slots
        meta = step_metadata(pages, [0] * batch, [2] * batch, n, hidden.device)
        last = self._run(prompt, meta, caches).view(batch, 2, -1)[:, 1]
        codes = [code0]
        for book in range(1, n):
            logits = self.fast_output(last)
            if on_logits is not None:
                on_logits(book, logits)
            code = logits.argmax(dim=-1) if sampler is None else sampler(logits, book)
            codes.append(code)
            if book < n - 1:  # the last code is never fed back
                meta = step_metadata(pages, [book + 1] * batch, [1] * batch, n, hidden.device)
                last = self._run(self.fast_embeddings(code), meta, caches)
        return Frame(torch.stack(codes, dim=1))


class DualAR(nn.Module):
    """Both ARs under the released names (``embeddings``, ``layers``, ``fast_layers``, ...)."""

    def __init__(self, config: DualARConfig) -> None:
        super().__init__()
        self.config = config
        self.slow = SlowAR(config)
        self.fast = FastAR(config)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the slow AR's paged KV cache."""
        return kv_cache_shape(self.config.slow_llama())

    def code0(self, tokens: torch.Tensor) -> torch.Tensor:
        """Codebook 0 of sampled slow tokens (0 for a token that is not a semantic token, as
        the reference clamps it)."""
        return (tokens - self.config.semantic_begin_id).clamp(min=0, max=self.config.codebook_size - 1)
