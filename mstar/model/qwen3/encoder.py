"""Qwen3 decoder stack run as a text ENCODER for diffusion conditioning (FLUX.2 klein, Z-Image).

Diffusion pipelines run the causal LM once over the padded prompt and keep some of the hidden
states that transformers returns with ``output_hidden_states=True``. Index convention (HF's):
``0`` is the embedding output, ``i`` the output of decoder layer ``i`` (1-based), and index
``num_hidden_layers`` is ``last_hidden_state``, i.e. the last layer's output *after* the final
norm. Negative indices count from the end as in Python (``-2``: output of the penultimate
layer, before any norm).

Only the layers up to the deepest tapped one are built (and need weights); the final norm only
when ``last_hidden_state`` is tapped. Attention is causal plus a key-padding mask, as transformers'
SDPA path computes it: positions are ``0..L-1`` whatever the padding, and a query row with no
visible key (a left-padding position) gets a zero attention output.

Parameter names equal the ``Qwen3ForCausalLM`` checkpoint keys (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_norm.weight``, ...); ``checkpoint_name_map`` also accepts bare
``Qwen3Model`` keys and drops the tensors this truncated encoder does not use.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.mlp import SwiGLU
from mstar.layers.norm import RMSNorm
from mstar.layers.rotary import RotaryEmbedding, apply_rotary
from mstar.model.qwen3.config import Qwen3Config

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


class Qwen3Attention(nn.Module):
    """Grouped-query self-attention with per-head RMSNorm on q and k (before RoPE)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x [B, L, hidden]``; ``mask [B, 1, L, L]`` (True = attend) or None for plain causal."""
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, length, -1, self.head_dim))
        v = self.v_proj(x).view(batch, length, -1, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
        )
        if mask is not None:
            # Rows with no visible key: zeros on every backend (torch's math kernel does this).
            out = torch.where(mask.any(dim=-1, keepdim=True), out, 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Stack(nn.Module):
    """Embeddings, the first ``num_layers`` decoder layers and optionally the final norm
    (the ``model.`` prefix of the HF keys)."""

    def __init__(self, config: Qwen3Config, num_layers: int, with_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config) for _ in range(num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if with_norm else None
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


def attention_mask_4d(attention_mask: torch.Tensor | None, length: int,
                      padded: bool | None = None) -> torch.Tensor | None:
    """Boolean ``[B, 1, L, L]`` causal-and-not-padding mask, or None when nothing is padded.

    ``padded``: whether any key is padding, when the caller knows it (a mask built on the
    host can say so for free); None reads it from the mask, which makes the host wait for
    the device when the mask lives there (and so cannot be captured in a CUDA graph)."""
    if attention_mask is None:
        return None
    keys = attention_mask.bool()
    if padded is None:
        padded = not bool(keys.all())
    if not padded:
        return None
    causal = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
    return causal[None, None] & keys[:, None, None, :]


class Qwen3TextEncoder(nn.Module):
    """A Qwen3 decoder stack returning selected hidden states (see the module docstring).

    ``tap_layers`` are HF ``hidden_states`` indices (default ``(-1,)``: ``last_hidden_state``);
    ``num_layers`` truncates the stack (default: just deep enough for the deepest tap).
    """

    def __init__(
        self,
        config: Qwen3Config,
        num_layers: int | None = None,
        tap_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        if tap_layers is None:
            tap_layers = (-1,) if num_layers is None else (num_layers,)
        taps = self.resolve_taps(config, tap_layers)
        deepest = max(taps)
        if num_layers is None:
            num_layers = deepest
        if not deepest <= num_layers <= config.num_hidden_layers:
            raise ValueError(
                f"num_layers={num_layers} must lie in [{deepest}, {config.num_hidden_layers}] "
                f"for taps {taps}"
            )
        self.num_layers = num_layers
        self.tap_layers = taps
        self.model = Qwen3Stack(config, num_layers, with_norm=config.num_hidden_layers in taps)

    @staticmethod
    def resolve_taps(config: Qwen3Config, tap_layers: Sequence[int]) -> tuple[int, ...]:
        """Non-negative hidden-state indices in ``[0, num_hidden_layers]`` (negatives wrap)."""
        count = config.num_hidden_layers + 1
        if not tap_layers:
            raise ValueError("tap_layers must not be empty")
        for i in tap_layers:
            if not -count <= i < count:
                raise ValueError(f"tap layer {i} out of range for {count - 1} layers")
        return tuple(i % count for i in tap_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        tap_layers: Sequence[int] | None = None,
        padded: bool | None = None,
    ) -> list[torch.Tensor]:
        """Hidden states ``[B, L, hidden]`` for each tap (in the order asked), from token ids
        ``[B, L]`` and an optional padding mask ``[B, L]`` (1/True = real token); ``padded``
        as in ``attention_mask_4d`` (pass it to keep the forward free of host syncs)."""
        taps = self.tap_layers if tap_layers is None else self.resolve_taps(self.config, tap_layers)
        final = self.config.num_hidden_layers
        for i in taps:
            if i > self.num_layers or (i == final and self.model.norm is None):
                raise ValueError(f"tap {i} needs layers or the final norm this encoder lacks")
        deepest = max(taps)
        x = self.model.embed_tokens(input_ids)
        length = x.shape[1]
        positions = torch.arange(length, device=x.device)
        cos_sin = self.model.rotary_emb.cos_sin(positions, x.dtype)
        mask = attention_mask_4d(attention_mask, length, padded)
        states = {0: x}
        for index, layer in enumerate(self.model.layers[:deepest], start=1):
            x = layer(x, cos_sin, mask)
            states[index] = x
        if final in taps:
            assert self.model.norm is not None
            states[final] = self.model.norm(x)
        return [states[i] for i in taps]

    def expected_keys(self) -> set[str]:
        """The checkpoint keys (``Qwen3ForCausalLM`` naming) this encoder needs."""
        return set(self.state_dict().keys())

    def checkpoint_name_map(self, name: str) -> str | None:
        """Map a ``Qwen3ForCausalLM`` or bare ``Qwen3Model`` checkpoint key to our parameter
        name; ``None`` for tensors skipped on purpose: ``lm_head``, layers beyond
        ``num_layers`` and, when not tapped, the final norm. Anything else passes through, so
        a loader's coverage check still catches stray keys."""
        if name.startswith("lm_head."):
            return None
        key = name if name.startswith("model.") else f"model.{name}"
        match = _LAYER_KEY.match(key)
        if match is not None:
            index = int(match.group(1))
            if self.num_layers <= index < self.config.num_hidden_layers:
                return None
        elif key.startswith("model.norm.") and self.model.norm is None:
            return None
        return key
