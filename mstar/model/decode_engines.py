"""How a Llama-family decode engine is built from its knobs (``DecodeKnobs``), shared by the
Llama LLMs and the Orpheus talker (which adds its token rules): ``fused_kernels`` goes to the
model, ``attention_backend``, ``cuda_graphs``, ``overlap_scheduling`` and ``prefix_caching`` to
the engine, as is ``max_prefill_tokens``; the KV pool from ``resources.kv_cache``.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.config import DeploymentConfig
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout, PrefillEngine
from mstar.engine.rules import TokenRules
from mstar.model.knobs import DecodeKnobs


def decode_engine(model, knobs: DecodeKnobs, config: DeploymentConfig, device: torch.device,
                  rules: TokenRules | None = None) -> AutoregressiveEngine:
    """The engine over ``model`` (a Llama-family decoder on ``device``) with the knobs' switches
    and the model's token ``rules`` (None: every token sampled); with ``cuda_graphs``, every
    batch bucket is captured now, so no request waits for a capture."""
    model.use_fused_kernels(knobs.fused_kernels)
    # cuda_graphs runs the Triton attention kernels: the torch reference syncs with the host
    backend = "triton" if knobs.cuda_graphs else knobs.attention_backend
    engine = AutoregressiveEngine(model, KVLayout(*model.cache_shape()), **_pool(config, device), rules=rules,
                                  attention_backend=backend, cuda_graphs=knobs.cuda_graphs,
                                  overlap_scheduling=knobs.overlap_scheduling, prefix_caching=knobs.prefix_caching,
                                  max_prefill_tokens=knobs.max_prefill_tokens)
    if engine.graphs is not None:
        engine.graphs.capture_all()
    if engine.prefill_graphs is not None:
        engine.prefill_graphs.capture_all()
    return engine


def prefill_engine(model, knobs: DecodeKnobs, config: DeploymentConfig, device: torch.device) -> PrefillEngine:
    """The prefill half of a disaggregated deployment: its own pool of the same size (it holds a
    request's prompt pages only, and the prefix cache: a request's pages go idle in it when it is
    handed off), the decoder's attention kernels (``cuda_graphs`` runs Triton's)."""
    model.use_fused_kernels(knobs.fused_kernels)
    backend = "triton" if knobs.cuda_graphs else knobs.attention_backend
    engine = AutoregressiveEngine(model, KVLayout(*model.cache_shape()), **_pool(config, device),
                                  attention_backend=backend, prefix_caching=knobs.prefix_caching,
                                  max_prefill_tokens=knobs.max_prefill_tokens)
    return PrefillEngine(engine)


def _pool(config: DeploymentConfig, device: torch.device) -> dict[str, Any]:
    """The KV pool's arguments (a tensor-parallel rank caches the KV heads it holds)."""
    kv = config.resources.kv_cache
    return dict(num_pages=kv.max_num_pages, page_size=kv.page_size, max_seq_len=config.max_seq_len,
                device=device, dtype=config.torch_dtype())
