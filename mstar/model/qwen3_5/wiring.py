"""How Qwen3.5's engines are built: the vision tower as a stateless engine (the media of many
requests in one forward), the hybrid decoder as a ``HybridEngine`` (paged KV for the attention
layers, a state-slot pool for the DeltaNet layers) with the knobs' ``attention_backend``."""

from __future__ import annotations

import torch

from mstar.config import DeploymentConfig
from mstar.engine.autoregressive import KVLayout
from mstar.engine.base import Engine, StatelessEngine
from mstar.model.qwen3_5.config import Qwen3_5VisionConfig
from mstar.model.qwen3_5.engine import HybridEngine, vision_fn
from mstar.model.qwen3_5.knobs import Qwen3_5Knobs


def qwen3_5_engines(model, tower, vision_config: Qwen3_5VisionConfig | None, knobs: Qwen3_5Knobs,
                    config: DeploymentConfig, max_slots: int, device: torch.device) -> dict[str, Engine]:
    """``vision`` over ``tower`` and ``llm`` over ``model``, for those that are not None."""
    engines: dict[str, Engine] = {}
    if tower is not None:
        engines["vision"] = StatelessEngine(vision_fn(tower))
    if model is None:
        return engines
    dtype = config.torch_dtype()
    media_ids = () if vision_config is None else (vision_config.image_token_id, vision_config.video_token_id)
    kv = config.resources.kv_cache
    engines["llm"] = HybridEngine(
        model, KVLayout(*model.cache_shape()),  # a tensor-parallel rank caches its KV heads
        num_state_layers=len(model.config.linear_layers), state_shapes=model.state_shapes(),
        max_slots=max_slots, state_dtype=state_dtype(model.config.mamba_ssm_dtype, config),
        media_token_ids=media_ids, num_pages=kv.max_num_pages, page_size=kv.page_size,
        max_seq_len=config.max_seq_len, device=device, dtype=dtype, attention_backend=knobs.attention_backend)
    return engines


def state_dtype(checkpoint_dtype: str | None, config: DeploymentConfig) -> torch.dtype:
    """``resources.gdn_state.state_dtype``; ``auto``: the checkpoint's ``mamba_ssm_dtype``,
    else float32."""
    pool = config.resources.gdn_state
    name = pool.state_dtype if pool is not None else "auto"
    if name == "auto":
        name = checkpoint_dtype or "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"mamba_ssm_dtype {name!r} is not a torch dtype")
    return dtype
