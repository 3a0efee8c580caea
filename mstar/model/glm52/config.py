"""GLM-5.2's architecture, read from the checkpoint's ``config.json`` (``model_type``
``glm_moe_dsa``): multi-head latent attention with the DSA indexer, a few dense MLP layers
then mixture-of-experts layers with a shared expert, and one multi-token-prediction layer
past the last decoder layer (loaded and skipped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Glm52Config:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288  # the dense MLP layers
    moe_intermediate_size: int = 2048  # one routed expert, and the shared expert per n_shared_experts
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 1  # routing picks the top ``topk_group`` of ``n_group`` expert groups first
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_topk: int = 2048  # keys each query attends to (DSA)
    index_head_dim: int = 128
    index_n_heads: int = 32
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 202752
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder's (skipped)
    eos_token_id: tuple[int, ...] = ()
    mlp_layer_types: tuple[str, ...] = field(default=())  # "dense" or "sparse" per layer
    indexer_types: tuple[str, ...] = field(default=())  # "full" (own indexer) or "shared" per layer

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.mlp_layer_types) != n or not set(self.mlp_layer_types) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types: {n} of 'dense'/'sparse', got {list(self.mlp_layer_types)}")
        if len(self.indexer_types) != n or not set(self.indexer_types) <= {"full", "shared"}:
            raise ValueError(f"indexer_types: {n} of 'full'/'shared', got {list(self.indexer_types)}")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ValueError("indexer_types: the first layer must run its own indexer ('full')")
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"n_group {self.n_group} must split {self.n_routed_experts} experts in groups of >= 2")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must hold the rotary part (qk_rope_head_dim)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """One cached row per token and layer: ``[latent | rotary key | indexer key]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Glm52Config:
        """From a ``config.json`` as released (or as transformers writes it)."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r}: only silu is supported")
        if d.get("scoring_func", "sigmoid") != "sigmoid":  # DeepSeek-style configs name the router's scores
            raise ValueError(f"scoring_func {d['scoring_func']!r}: only sigmoid routing is supported")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope type {rope.get('rope_type', rope.get('type'))!r}: only the default "
                             "rotary embedding is supported")
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            dense = min(int(d.get("first_k_dense_replace", 3)), n)
            mlp_types = ["dense"] * dense + ["sparse"] * (n - dense)
        indexer_types = d.get("indexer_types")
        if indexer_types is None and d.get("index_topk_pattern") is not None:
            pattern = d["index_topk_pattern"]
            indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
        if indexer_types is None:  # every ``freq``-th layer from ``offset - 1`` on runs its own indexer
            freq = max(int(d.get("index_topk_freq", 1)), 1)
            offset = int(d.get("index_skip_topk_offset", 2))
            indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        names = {f for f in cls.__dataclass_fields__} - {"rope_theta", "mlp_layer_types", "indexer_types",
                                                          "eos_token_id"}
        kwargs = {k: d[k] for k in names if d.get(k) is not None}
        if d.get("num_experts") is not None:
            kwargs["n_routed_experts"] = d["num_experts"]
        return cls(**kwargs, rope_theta=theta, mlp_layer_types=tuple(mlp_types),
                   indexer_types=tuple(indexer_types), eos_token_id=eos)
