"""What tensor parallelism splits in Qwen3-Omni, by node, for the startup check.

``thinker``: its text decoder (attention heads and KV heads as Llama's, every expert's
``moe_intermediate_size`` features, the dense layers' ``intermediate_size``, the vocabulary
padded); the audio and vision towers are whole on every rank (plain ``nn.Linear`` layers,
each rank runs them for its own copy of the prompt's embeddings). ``talker``: its decoder the
same way (plus the shared expert's features, its gate whole), and the code predictor's
attention and MLP (its per-codebook heads and embeddings whole); the two thinker projections
are whole. ``code2wav`` is not split: it goes in a node group of its own (tp_size 1).

A size here that ``tp_size`` does not divide fails placement, naming the ``config.json`` key.
"""

from __future__ import annotations

from typing import Any

from mstar.distributed.dims import ParallelDims
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.talker import Qwen3OmniTalkerConfig


def decoder_dims(config: Qwen3OmniTextConfig, prefix: str) -> dict[str, int]:
    """The sizes a thinker-style decoder splits, under their ``config.json`` keys."""
    layers = range(config.num_hidden_layers)
    dims = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    if any(config.is_sparse(i) for i in layers):
        dims["moe_intermediate_size"] = config.moe_intermediate_size
        if config.shared_expert_intermediate_size > 0:
            dims["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if not all(config.is_sparse(i) for i in layers):
        dims["intermediate_size"] = config.intermediate_size
    return {prefix + name: size for name, size in dims.items()}


def omni_dims(hf_config: dict[str, Any]) -> dict[str, ParallelDims]:
    """Per splittable node, its sizes ``tp_size`` must divide (``ModelSpec.parallel_dims``)."""
    dims = {"thinker": ParallelDims(tensor=decoder_dims(Qwen3OmniTextConfig.from_hf_dict(hf_config),
                                                        "thinker_config.text_config."))}
    if "talker_config" in hf_config:
        talker = Qwen3OmniTalkerConfig.from_hf_dict(hf_config)
        predictor = talker.code_predictor
        sizes = decoder_dims(talker.text, "talker_config.text_config.")
        sizes |= {f"talker_config.code_predictor_config.{name}": size for name, size in (
            ("num_attention_heads", predictor.num_attention_heads),
            ("num_key_value_heads", predictor.num_key_value_heads),
            ("intermediate_size", predictor.intermediate_size))}
        dims["talker"] = ParallelDims(tensor=sizes)
    return dims
