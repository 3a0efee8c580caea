"""The Gemma 4 text model as LTX-2.5's prompt encoder: token ids -> every layer's hidden states.

Only the text path of transformers' ``Gemma4UnifiedForConditionalGeneration`` (5.25) runs here:
the prompt is one left-padded prefill, no cache, no image/audio towers. Parameter names equal
the text model's keys (``embed_tokens``, ``layers.N...``, ``norm``), which sit under
``model.language_model.`` in the released checkpoint.

What makes Gemma 4 differ from a plain decoder:

* two kinds of layers (``layer_types``): sliding-window layers (keys within the last
  ``sliding_window`` positions) and full-attention layers, which may have their own head width
  and key/value head count (``per_layer_config``), use a "proportional" rotary (only the first
  ``partial_rotary_factor`` of each head turns) at another base, and, with
  ``attention_k_eq_v``, take the values from the key projection;
* queries and keys are RMS normed per head with weights, values without; attention is
  unscaled (``scaling`` 1);
* each sub-block is sandwiched between two RMS norms, and the layer output is multiplied by a
  stored ``layer_scalar``;
* the last ``num_kv_shared_layers`` layers compute no keys or values: each reuses those of the
  last earlier layer of its kind.

``hidden_states`` returns what ``output_hidden_states=True`` gives: the scaled embeddings, then
each layer's output, the last one after the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GemmaLayerSpec:
    sliding: bool
    head_dim: int
    kv_heads: int
    values_from_keys: bool
    kv_role: str | None  # None: own keys/values; "store": later layers reuse them; "reuse"


@dataclass(frozen=True)
class GemmaTextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    sliding_window: int
    pad_token_id: int | None
    layers: tuple[GemmaLayerSpec, ...]
    rope: dict[str, tuple[float, float]]  # layer kind -> (theta, rotated fraction of the head)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmaTextConfig:
        """From a Gemma 4 text ``config.json`` dict (or a composite one's ``text_config``)."""
        data = data.get("text_config", data)
        if data.get("use_bidirectional_attention") == "all":
            raise ValueError("text_encoder config: use_bidirectional_attention 'all' is not supported")
        if data.get("use_double_wide_mlp"):
            raise ValueError("text_encoder config: use_double_wide_mlp is not supported")
        if data.get("attention_bias"):
            raise ValueError("text_encoder config: attention_bias is not supported")
        if data.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"text_encoder config: hidden_activation {data['hidden_activation']!r} is not supported")
        count = data["num_hidden_layers"]
        types = data.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(count)]
        overrides = {int(k): v for k, v in (data.get("per_layer_config") or {}).items()}
        shared = data.get("num_kv_shared_layers", 0)
        roles: list[str | None] = [None] * (count - shared) + ["reuse"] * shared
        if shared:
            for kind in set(types):
                last = max(i for i in range(count - shared) if types[i] == kind)
                roles[last] = "store"
        layers = []
        for i, kind in enumerate(types):
            extra = overrides.get(i, {})
            full = kind == "full_attention"
            layers.append(GemmaLayerSpec(
                sliding=not full, head_dim=extra.get("head_dim", data.get("head_dim", 256)),
                kv_heads=extra.get("num_key_value_heads", data.get("num_key_value_heads", 4)),
                values_from_keys=bool(data.get("attention_k_eq_v", False)) and full, kv_role=roles[i]))
        rope = {}
        for kind, params in (data.get("rope_parameters") or {}).items():
            if params.get("rope_type", "default") not in ("default", "proportional") or params.get("factor", 1.0) != 1:
                raise ValueError(f"text_encoder config: rope {params} for {kind} is not supported")
            fraction = params.get("partial_rotary_factor", 1.0) if params.get("rope_type") == "proportional" else 1.0
            rope[kind] = (float(params["rope_theta"]), float(fraction))
        return cls(vocab_size=data["vocab_size"], hidden_size=data["hidden_size"],
                   intermediate_size=data["intermediate_size"], num_attention_heads=data["num_attention_heads"],
                   rms_norm_eps=data.get("rms_norm_eps", 1e-6), sliding_window=data.get("sliding_window", 1024),
                   pad_token_id=data.get("pad_token_id", 0), layers=tuple(layers), rope=rope)


class GemmaRMSNorm(nn.Module):
    """``x * (mean(x^2) + eps)^-0.5``, times ``weight`` where it has one, in float32."""

    def __init__(self, dim: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, fraction: float) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """(cos, sin) ``[L, head_dim]`` in the rotate-half layout; only the first
    ``fraction * head_dim / 2`` frequencies turn (the rest have frequency 0)."""
    turned = int(fraction * head_dim // 2)
    inv = 1.0 / theta ** (torch.arange(0, 2 * turned, 2, dtype=torch.int64).float() / head_dim)
    inv = torch.cat([inv, torch.zeros(head_dim // 2 - turned)])
    angles = positions.float()[:, None] * inv[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, L, H, D]`` turned by tables ``[L, D]`` (pairs ``(i, i + D/2)``)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-second, first], dim=-1) * sin[:, None]


class GemmaAttention(nn.Module):
    def __init__(self, c: GemmaTextConfig, spec: GemmaLayerSpec) -> None:
        super().__init__()
        self.spec, self.heads = spec, c.num_attention_heads
        d, eps = spec.head_dim, c.rms_norm_eps
        self.q_proj = nn.Linear(c.hidden_size, self.heads * d, bias=False)
        self.q_norm = GemmaRMSNorm(d, eps)
        if spec.kv_role != "reuse":
            self.k_proj = nn.Linear(c.hidden_size, spec.kv_heads * d, bias=False)
            self.v_proj = None if spec.values_from_keys else nn.Linear(c.hidden_size, spec.kv_heads * d, bias=False)
            self.k_norm = GemmaRMSNorm(d, eps)
            self.v_norm = GemmaRMSNorm(d, eps, scaled=False)
        self.o_proj = nn.Linear(self.heads * d, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor,
                shared: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        b, length, _ = x.shape
        d = self.spec.head_dim
        q = rotate(self.q_norm(self.q_proj(x).view(b, length, -1, d)), *rope).transpose(1, 2)
        if self.spec.kv_role == "reuse":
            k, v = shared[self.spec.sliding]
        else:
            k = self.k_proj(x).view(b, length, -1, d)
            v = k if self.v_proj is None else self.v_proj(x).view(b, length, -1, d)
            k = rotate(self.k_norm(k), *rope).transpose(1, 2)
            v = self.v_norm(v).transpose(1, 2)
            if self.spec.kv_role == "store":
                shared[self.spec.sliding] = (k, v)
        groups = self.heads // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class GemmaMLP(nn.Module):
    def __init__(self, c: GemmaTextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaLayer(nn.Module):
    def __init__(self, c: GemmaTextConfig, spec: GemmaLayerSpec) -> None:
        super().__init__()
        eps = c.rms_norm_eps
        self.self_attn = GemmaAttention(c, spec)
        self.mlp = GemmaMLP(c)
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor,
                shared: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, bias, shared))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class GemmaTextModel(nn.Module):
    def __init__(self, config: GemmaTextConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.layers = nn.ModuleList(GemmaLayer(c, spec) for spec in c.layers)
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def masks(self, keep: torch.Tensor, dtype: torch.dtype) -> dict[bool, torch.Tensor]:
        """Additive biases ``[B, 1, L, L]`` for full (False) and sliding (True) layers: causal,
        padded keys off, sliding keys within ``sliding_window`` positions."""
        length = keep.shape[1]
        pos = torch.arange(length, device=keep.device)
        causal = pos[None, :] <= pos[:, None]
        near = pos[None, :] > pos[:, None] - self.config.sliding_window
        off = torch.finfo(dtype).min
        out = {}
        for sliding, allowed in ((False, causal), (True, causal & near)):
            ok = allowed[None, None] & keep.bool()[:, None, None, :]
            out[sliding] = torch.zeros(ok.shape, dtype=dtype, device=keep.device).masked_fill(~ok, off)
        return out

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``ids``/``mask [B, L]`` (left padded) -> ``1 + layers`` states ``[B, L, hidden]``. Padded
        positions' states are meaningless (the connectors drop them)."""
        c = self.config
        x = self.embed_tokens(ids) * torch.tensor(c.hidden_size**0.5, dtype=self.embed_tokens.weight.dtype)
        positions = torch.arange(ids.shape[1], device=ids.device)
        ropes = {}
        for sliding in (False, True):
            kind = "sliding_attention" if sliding else "full_attention"
            specs = [s for s in c.layers if s.sliding == sliding]
            if specs:
                theta, fraction = c.rope[kind]
                cos, sin = rotary_tables(positions, specs[0].head_dim, theta, fraction)
                ropes[sliding] = (cos.to(x.dtype), sin.to(x.dtype))
        biases = self.masks(mask, x.dtype)
        shared: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        states = [x]
        for layer, spec in zip(self.layers, c.layers):
            x = layer(x, ropes[spec.sliding], biases[spec.sliding], shared)
            states.append(x)
        states[-1] = self.norm(x)
        return tuple(states)
