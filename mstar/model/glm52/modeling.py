"""GLM-5.2's decoder on a paged latent cache: ``Glm52ForCausalLM``.

Pre-norm decoder layers of MLA + DSA attention (``attention.py``) and a feed-forward that is a
dense SwiGLU in the first layers and the MoE with a shared expert after (``moe.py``).
Parameter names are the released checkpoint's keys (``model.layers.{i}.self_attn.q_a_proj``,
``...mlp.experts.{j}.gate_proj``, ``lm_head``), except the fused ``gate_up_proj`` of the SwiGLUs
and the stacked experts, which ``mstar.model.weights.load_weights`` fills from the separate
keys through their segment loaders. The multi-token-prediction layer stored after the last
decoder layer is not built (``checkpoint.py`` skips its keys).

The step's interface is the Llama decoder's: ``forward(input_ids, meta, kv_caches)`` gives the
final-normed hidden states of the step's new tokens, ``compute_logits`` their logits, and
``cache_shape`` the paged cache it fills: one ``planes=1`` row per token and layer.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.linear import ParallelLMHead, VocabParallelEmbedding
from mstar.layers.mlp import SwiGLU
from mstar.layers.norm import RMSNorm
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.glm52.attention import Glm52Attention, Glm52Indexer, rope_tables
from mstar.model.glm52.config import Glm52Config
from mstar.model.glm52.moe import Glm52MoE, Glm52Router


class Glm52DecoderLayer(nn.Module):
    def __init__(self, config: Glm52Config, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Glm52Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.mlp_layer_types[layer] == "sparse"
        self.mlp = Glm52MoE(config) if sparse else SwiGLU(config.hidden_size, config.intermediate_size, fused=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PagedAttentionMetadata,
                kv_cache: torch.Tensor, chosen: dict | None) -> tuple[torch.Tensor, dict]:
        attn, chosen = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, chosen)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), chosen


class Glm52Model(nn.Module):
    """Embeddings, decoder layers and the final norm (the ``model.`` prefix of the keys)."""

    def __init__(self, config: Glm52Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Glm52DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        x = self.embed_tokens(input_ids)
        cos, sin = rope_tables(meta.positions.to(x.device), self.config.qk_rope_head_dim, self.config.rope_theta)
        chosen = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, chosen = layer(x, cos, sin, meta, kv_cache, chosen)
        return self.norm(x)


class Glm52ForCausalLM(nn.Module):
    def __init__(self, config: Glm52Config) -> None:
        super().__init__()
        self.config = config
        self.model = Glm52Model(config)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's ``T`` new tokens."""
        return self.model(input_ids, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` (the whole vocabulary on every rank)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.logits(hidden)
        return self.lm_head(hidden)

    def cache_shape(self) -> tuple[int, int, int, int]:
        """``(num_layers, 1, cache_width, planes=1)`` of the paged cache (``KVLayout``): one
        latent row per token and layer, the same on every tensor-parallel rank."""
        return len(self.model.layers), 1, self.config.cache_width, 1

    def to_dtype(self, dtype: torch.dtype) -> Glm52ForCausalLM:
        """``self.to(dtype)``, the routers and the indexers' head weights kept in float32 (they
        choose the experts and the keys; the reference keeps them so too)."""
        self.to(dtype)
        for module in self.modules():
            if isinstance(module, Glm52Router):
                module.float()
            elif isinstance(module, Glm52Indexer):
                module.weights_proj.float()
        return self

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """No fused kernels yet: eager torch only (the engine wiring calls this)."""
        if enabled:
            raise ValueError("fused_kernels: GLM-5.2 has no fused kernels yet")
