"""The Nemotron-H hybrid language model on a paged KV cache and recurrent-state slots.

Every layer is ``x + mixer(norm(x))`` with one mixer: a Mamba-2 mixer (state in slots, see
``mstar.layers.mamba2``), grouped-query attention over the paged KV cache with no positional
encoding at all (the Mamba layers carry the order), or a ``relu(x)^2`` MLP. Parameter names
are the released checkpoint's (``backbone.embeddings``, ``backbone.layers.<i>.norm``,
``backbone.layers.<i>.mixer.*``, ``backbone.norm_f``, ``lm_head``).

A step's input embeddings are an argument (``inputs_embeds``): the duplex model feeds the
step with an audio frame fused with the previous agent tokens instead of a token lookup.
Not tensor-parallel: every layer is a plain ``torch.nn`` module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention import paged_attention
from mstar.layers.gated_deltanet import StateBatch
from mstar.layers.mamba2 import Mamba2Mixer
from mstar.layers.paged_kv import PagedAttentionMetadata
from mstar.model.nemotron_h.config import ATTENTION, MAMBA, NemotronHConfig


class NemotronHRMSNorm(nn.Module):
    """RMS norm whose scale multiplies in float32 before the cast back (as the reference)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class NemotronHAttention(nn.Module):
    """Grouped-query attention, no positional encoding, over the paged KV cache."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        self.q_proj = nn.Linear(config.hidden_size, heads * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=False)
        self.o_proj = nn.Linear(heads * d, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.head_dim**-0.5)
        return self.o_proj(out.reshape(tokens, -1))


class NemotronHMLP(nn.Module):
    """``down(relu(up(x))^2)``."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


@dataclass
class NemotronHCaches:
    """A step's view of the per-layer caches: a paged KV tensor per attention layer, a conv
    window and an SSM state tensor (``[slots, ...]``) per Mamba layer, in layer order."""

    kv: list[torch.Tensor]
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]


class NemotronHBlock(nn.Module):
    def __init__(self, config: NemotronHConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.norm = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if layer_type == MAMBA:
            self.mixer = Mamba2Mixer(
                config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                config.ssm_state_size, config.conv_kernel, chunk_size=config.chunk_size, use_bias=config.use_bias,
                use_conv_bias=config.use_conv_bias, eps=config.layer_norm_epsilon,
                time_step_limit=config.time_step_limit)
        elif layer_type == ATTENTION:
            self.mixer = NemotronHAttention(config)
        else:
            self.mixer = NemotronHMLP(config)


class NemotronHModel(nn.Module):
    """Embeddings, the hybrid layers and the final norm (the ``backbone.`` prefix)."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, t) for t in config.layer_types)
        self.norm_f = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, meta: PagedAttentionMetadata, states: StateBatch,
                caches: NemotronHCaches) -> torch.Tensor:
        config = self.config
        if len(caches.kv) != len(config.attention_layers) or len(caches.conv) != len(config.mamba_layers) \
                or len(caches.ssm) != len(config.mamba_layers):
            raise ValueError(f"expected {len(config.attention_layers)} KV caches and {len(config.mamba_layers)} "
                             f"conv/SSM states, got {len(caches.kv)}, {len(caches.conv)} and {len(caches.ssm)}")
        kv, recurrent = iter(caches.kv), iter(zip(caches.conv, caches.ssm))
        for layer in self.layers:
            h = layer.norm(x)
            if layer.layer_type == MAMBA:
                h = layer.mixer(h, states, *next(recurrent))
            elif layer.layer_type == ATTENTION:
                h = layer.mixer(h, meta, next(kv))
            else:
                h = layer.mixer(h)
            x = x + h
        return self.norm_f(x)


class NemotronHForCausalLM(nn.Module):
    """The backbone with its head, one paged step per ``forward``."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = NemotronHModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor | None, meta: PagedAttentionMetadata, states: StateBatch,
                caches: NemotronHCaches, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the step's ``T`` new tokens;
        ``inputs_embeds [T, hidden]`` replaces the embedding lookup when given."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.backbone(x, meta, states, caches)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.backbone.embeddings.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def cache_shape(self) -> tuple[int, int, int]:
        """``(attention layers, KV heads, head_dim)`` of the paged KV cache."""
        config = self.config
        return len(config.attention_layers), config.num_key_value_heads, config.head_dim

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot shapes of one Mamba layer's states (all are alike): ``conv`` and ``ssm``."""
        mamba = self.config.mamba_layers
        return self.backbone.layers[mamba[0]].mixer.state_shapes() if mamba else {}
