"""Command A+ (Cohere2-MoE) decoder on a paged KV cache.

A layer is parallel: one norm, then attention and the MLP both read its output, and both add
to the residual stream (``x + attn(h) + mlp(h)``). Three sliding-window layers (RoPE on
adjacent channel pairs, a window of ``sliding_window`` positions) come before each global one
(no position embedding). The MLP of a sparse layer routes each token to ``num_experts_per_tok``
of ``num_experts`` SwiGLU experts (top-k of the router logits, softmax over those k) on the
fused MoE layer (``mstar.layers.moe.MoEExperts``) and adds an always-on shared expert,
averaged with the routed sum (or summed, as the config says). Embeddings are tied; logits are
scaled by ``logit_scale``.

Parameter names are the released checkpoint's keys, but for the fused projections
(``self_attn.qkv_proj``, ``gate_up_proj``, the stacked experts), which ``load_weights`` fills
from the unfused keys through their segment loaders.

Tensor parallelism lives in the layers: each rank holds its share of the heads, the shared
expert's features and every expert's features; the router is whole on every rank. The image
encoder lives on the first rank only, which broadcasts each image's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.collectives import all_reduce, broadcast
from mstar.distributed.state import current_parallel
from mstar.layers.attention import paged_attention
from mstar.layers.linear import QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mstar.layers.mlp import SwiGLU
from mstar.layers.moe import MoEExperts
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.layers.rotary import apply_rotary_pairs, rope_inv_freq
from mstar.model.command_a_plus.config import CommandAPlusConfig, CommandVisionConfig
from mstar.model.command_a_plus.vision import CommandVision


class BiasFreeLayerNorm(nn.Module):
    """LayerNorm with a scale and no bias, statistics in float32 (Cohere's norm when the config
    has no ``rms_norm_eps``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


def make_norm(config: CommandAPlusConfig) -> nn.Module:
    if config.rms_norm_eps is not None:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)
    return BiasFreeLayerNorm(config.hidden_size, config.layer_norm_eps)


class CommandAttention(nn.Module):
    """Grouped-query attention over one layer's paged cache: RoPE on channel pairs and a
    sliding ``window`` for a local layer, neither for a global one."""

    def __init__(self, config: CommandAPlusConfig, layer: int) -> None:
        super().__init__()
        assert config.head_dim is not None and config.num_key_value_heads is not None
        self.head_dim = d = config.head_dim
        self.scale = d**-0.5
        self.window = config.window(layer)
        self.rotary = config.rotary(layer)
        heads, bias = config.num_attention_heads, config.attention_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, heads, config.num_key_value_heads, bias=bias,
                                          segment_names=("q_proj", "k_proj", "v_proj"))
        self.o_proj = RowParallelLinear(heads * d, config.hidden_size, bias=bias, block=d)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: PagedAttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = (part.view(tokens, -1, self.head_dim) for part in self.qkv_proj.split_output(qkv))
        if self.rotary:
            q, k = (apply_rotary_pairs(t, *cos_sin) for t in (q, k))
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(tokens, -1))


class CommandMoE(nn.Module):
    """Routed experts plus the shared expert. The router (``gate.weight [E, H]``) takes the
    top-k logits, then a softmax over them (or sigmoids, renormalised with ``norm_topk_prob``);
    the shared expert is ``num_shared_experts`` experts wide, one SwiGLU. Under tensor
    parallelism the experts and the shared expert give this rank's partial sums and the block
    all-reduces once."""

    def __init__(self, config: CommandAPlusConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.top_k = config.num_experts_per_tok
        self.selection = config.expert_selection_fn
        self.normalize = config.norm_topk_prob
        self.average = config.shared_expert_combination_strategy == "average"
        self.tp = current_parallel().tp
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = MoEExperts(config.num_experts, hidden, inner)
        shared = inner * config.num_shared_experts
        self.shared_experts = SwiGLU(hidden, shared, fused=True) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids, topk_weights) [T, k]`` of tokens ``x [T, H]``."""
        scores, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
        if self.selection == "softmax":
            weights = F.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            weights = torch.sigmoid(scores)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))
        if self.shared_experts is None:
            return all_reduce(out, self.tp)
        out = all_reduce(out + self._shared(x), self.tp)
        return out / 2 if self.average else out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, or under tensor parallelism this rank's partial of it."""
        expert = self.shared_experts
        assert expert is not None
        if self.tp.size == 1:
            return expert(x)
        gate, up = expert.gate_up_proj.split_output(expert.gate_up_proj(x))
        return F.linear(F.silu(gate) * up, expert.down_proj.weight)


class CommandDecoderLayer(nn.Module):
    def __init__(self, config: CommandAPlusConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config)
        self.self_attn = CommandAttention(config, layer)
        if config.mlp_layer_types[layer] == "dense":
            inner = config.prefix_dense_intermediate_size or config.intermediate_size
            self.mlp: nn.Module = SwiGLU(config.hidden_size, inner, fused=True)
        else:
            self.mlp = CommandMoE(config)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: PagedAttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, cos_sin, meta, kv_cache) + self.mlp(h)


class CommandModel(nn.Module):
    """Embeddings, decoder layers and the final norm (the ``model.`` prefix of the keys)."""

    def __init__(self, config: CommandAPlusConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CommandDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        assert config.head_dim is not None
        self._inv_freq = rope_inv_freq(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        freqs = meta.positions.float()[:, None] * self._inv_freq.to(meta.positions.device)[None, :]
        cos_sin = (freqs.cos().to(x.dtype), freqs.sin().to(x.dtype))
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos_sin, meta, kv_cache)
        return self.norm(x)


class CommandAPlusForCausalLM(nn.Module):
    """The Command A+ text decoder with its tied, scaled language-model head, one paged step
    per ``forward``; with a ``vision`` config also the image encoder (``vision.*``), whose
    tokens enter as ``inputs_embeds``. Under tensor parallelism only the decoder's first rank
    holds and runs the encoder; it broadcasts the image's tokens to the other ranks."""

    def __init__(self, config: CommandAPlusConfig, vision: CommandVisionConfig | None = None) -> None:
        super().__init__()
        if not config.tie_word_embeddings:
            raise NotImplementedError("Command A+ ties its embeddings; an untied lm_head is not supported")
        self.config = config
        self.vision_config = vision
        self.tp = current_parallel().tp
        self.model = CommandModel(config)
        encodes = vision is not None and self.tp.rank == 0
        self.vision = CommandVision(vision, config.hidden_size) if encodes else None

    def forward(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's new tokens
        (``inputs_embeds [T, hidden]``, when given, replaces the embedding lookup)."""
        return self.model(input_ids, meta, kv_caches, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_with_images(self, input_ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
        """Embeddings ``[T, hidden]`` of ``input_ids`` whose image placeholders
        (``image_token_id``) take, in order, the tokens of the tiles ``pixels [n, 3, S, S]``."""
        embeds = self.embed_input_ids(input_ids)
        if pixels is None:
            return embeds
        if self.vision_config is None:
            raise ValueError("this checkpoint has no vision tower: it reads text only")
        slots = input_ids == self.vision_config.image_token_id
        count = pixels.shape[0] * self.vision_config.tokens_per_tile
        if int(slots.sum()) != count:
            raise ValueError(f"{int(slots.sum())} image placeholders for {count} image tokens")
        embeds[slots] = self.encode_images(pixels, embeds.dtype)
        return embeds

    def encode_images(self, pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The image tokens ``[n * tokens_per_tile, hidden]`` of the tiles ``pixels``: encoded on
        the first TP rank, which broadcasts them; the other ranks only receive."""
        assert self.vision_config is not None
        if self.vision is not None:
            image = self.vision(pixels.to(dtype)).to(dtype).contiguous()
        elif self.tp.rank == 0:
            raise ValueError("this model was built without its vision tower: it reads text only")
        else:
            image = torch.empty(pixels.shape[0] * self.vision_config.tokens_per_tile, self.config.hidden_size,
                                dtype=dtype, device=pixels.device)
        return broadcast(image, self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` on every rank: the tied embeddings, times ``logit_scale``."""
        return self.model.embed_tokens.logits(hidden) * self.config.logit_scale

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache this rank fills."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    def kv_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: a global layer), for the engine's page release."""
        return tuple(layer.self_attn.window for layer in self.model.layers)
