"""Hyper-parameters of Fish Audio's dual-AR text-to-semantic model.

Names and defaults follow the ``config.json`` of fish-speech's ``DualARModelArgs`` (the
slow AR's ``dim``, ``n_layer``, ... and the fast AR's ``fast_*`` settings, each falling back
to its slow counterpart when unset), so a file omitting a key means the same here as there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mstar.model.llama.config import LlamaConfig


@dataclass
class DualARConfig:
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = -1  # key/value heads; -1: n_head
    dim: int = 4096
    head_dim: int = 64
    intermediate_size: int | None = None  # None: 8/3 dim rounded up to a multiple of 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    codebook_size: int = 160
    num_codebooks: int = 4
    attention_qkv_bias: bool = False
    attention_o_bias: bool = False
    attention_qk_norm: bool = False
    tie_word_embeddings: bool = True
    scale_codebook_embeddings: bool = False
    n_fast_layer: int = 4
    fast_dim: int | None = None
    fast_n_head: int | None = None
    fast_n_local_heads: int | None = None
    fast_head_dim: int | None = None
    fast_intermediate_size: int | None = None
    fast_attention_qk_norm: bool | None = None
    norm_fastlayer_input: bool = False  # the fast AR reads the slow AR's final-normed state (S2)
    # not in config.json: the tokenizer's ids, filled in by the checkpoint
    semantic_begin_id: int = 151678  # ``<|semantic:0|>``; ``<|semantic:k|>`` is begin + k
    eos_token_id: int = 151645  # ``<|im_end|>``: the slow AR's stop token

    def __post_init__(self) -> None:
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = -(-int(8 * self.dim / 3) // 256) * 256
        self.fast_dim = self.fast_dim or self.dim
        self.fast_n_head = self.fast_n_head or self.n_head
        self.fast_n_local_heads = self.fast_n_local_heads or self.n_local_heads
        self.fast_head_dim = self.fast_head_dim or self.head_dim
        self.fast_intermediate_size = self.fast_intermediate_size or self.intermediate_size
        if self.fast_attention_qk_norm is None:
            self.fast_attention_qk_norm = self.attention_qk_norm
        if self.attention_qkv_bias or self.attention_o_bias:
            raise NotImplementedError("attention biases: the S2-Pro release has none")
        if self.num_codebooks < 2:
            raise ValueError(f"num_codebooks {self.num_codebooks}: the fast AR needs at least 2")
        if self.semantic_begin_id + self.codebook_size > self.vocab_size:
            raise ValueError("semantic tokens <|semantic:0..codebook_size-1|> must lie inside vocab_size")

    @property
    def semantic_end_id(self) -> int:
        return self.semantic_begin_id + self.codebook_size - 1

    def slow_llama(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.dim, intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.n_layer, num_attention_heads=self.n_head,
                           num_key_value_heads=self.n_local_heads, head_dim=self.head_dim, rms_norm_eps=self.norm_eps,
                           rope_theta=self.rope_base, max_position_embeddings=self.max_seq_len)

    def fast_llama(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.codebook_size, hidden_size=self.fast_dim,
                           intermediate_size=self.fast_intermediate_size, num_hidden_layers=self.n_fast_layer,
                           num_attention_heads=self.fast_n_head, num_key_value_heads=self.fast_n_local_heads,
                           head_dim=self.fast_head_dim, rms_norm_eps=self.norm_eps, rope_theta=self.rope_base,
                           max_position_embeddings=self.num_codebooks)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DualARConfig:
        """From a fish-speech ``config.json`` dict (unknown keys ignored): the flat
        ``dual_ar`` form, or S2's ``fish_qwen3_omni`` form (``text_config`` for the slow AR,
        ``audio_decoder_config`` for the fast AR, the semantic token range at the top),
        read as fish-speech reads it: codebook embeddings scaled, the fast AR on normed input."""
        if d.get("model_type") == "fish_qwen3_omni":
            d = {**_flatten_s2(d), **{k: d[k] for k in ("eos_token_id",) if k in d}}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})


def _flatten_s2(d: dict[str, Any]) -> dict[str, Any]:
    text, fast = d["text_config"], d["audio_decoder_config"]
    flat = {k: v for k, v in text.items() if k != "model_type"}
    flat.update(scale_codebook_embeddings=True, norm_fastlayer_input=True, codebook_size=fast["vocab_size"],
                num_codebooks=fast["num_codebooks"], n_fast_layer=fast["n_layer"])
    for name in ("dim", "n_head", "n_local_heads", "head_dim", "intermediate_size", "attention_qk_norm"):
        if fast.get(name) is not None:
            flat["fast_" + name] = fast[name]
    for name in ("attention_qkv_bias", "attention_o_bias"):
        if fast.get(name):
            flat[name] = True  # refused in __post_init__, as the slow AR's are
    if "semantic_start_token_id" in d:
        flat["semantic_begin_id"] = d["semantic_start_token_id"]
    return flat
