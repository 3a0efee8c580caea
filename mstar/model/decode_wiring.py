"""How a Llama-family decode engine is built from its knobs (``DecodeKnobs``), shared by the
Llama LLMs and the Orpheus talker: ``fused_kernels`` goes to the model, ``attention_backend``,
``cuda_graphs`` and ``overlap_scheduling`` to the engine; the KV pool from ``resources.kv_cache``.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.config import DeploymentConfig
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout, PrefillEngine
from mstar.model.knobs import DecodeKnobs


def decode_engine(model, knobs: DecodeKnobs, config: DeploymentConfig, device: torch.device,
                  engine: type[AutoregressiveEngine] = AutoregressiveEngine) -> AutoregressiveEngine:
    """``engine`` over ``model`` (a Llama-family decoder on ``device``) with the knobs' switches;
    with ``cuda_graphs``, every batch bucket is captured now, so no request waits for a capture."""
    model.use_fused_kernels(knobs.fused_kernels)
    built = engine(model, KVLayout(*model.cache_shape()), **_pool(config, device), **_switches(model, knobs, config))
    if built.graph_runner is not None:
        built.graph_runner.capture_all()
    return built


def prefill_engine(model, knobs: DecodeKnobs, config: DeploymentConfig, device: torch.device) -> PrefillEngine:
    """The prefill half of a disaggregated deployment: its own pool of the same size (it holds a
    request's prompt pages only), the decoder's attention kernels (``cuda_graphs`` runs Triton's)."""
    model.use_fused_kernels(knobs.fused_kernels)
    backend = "triton" if knobs.cuda_graphs else knobs.attention_backend
    return PrefillEngine(model, KVLayout(*model.cache_shape()), **_pool(config, device), attention_backend=backend)


def _pool(config: DeploymentConfig, device: torch.device) -> dict[str, Any]:
    """The KV pool's arguments (a tensor-parallel rank caches the KV heads it holds)."""
    kv = config.resources.kv_cache
    return dict(num_pages=kv.max_num_pages, page_size=kv.page_size, max_seq_len=config.max_seq_len,
                device=device, dtype=config.torch_dtype())


def _switches(model, knobs: DecodeKnobs, config: DeploymentConfig) -> dict[str, Any]:
    """The engine's fast-path arguments; ``cuda_graphs`` captures decode steps per batch
    bucket with the Triton attention kernels."""
    if not knobs.cuda_graphs:
        return {"attention_backend": knobs.attention_backend, "overlap_scheduling": knobs.overlap_scheduling}
    from mstar.engine.cuda_graphs import DecodeGraphRunner

    page_size = config.resources.kv_cache.page_size
    runner = DecodeGraphRunner(model, None, page_size, -(-config.max_seq_len // page_size), backend="triton")
    return {"attention_backend": "triton", "graph_runner": runner, "overlap_scheduling": knobs.overlap_scheduling}
