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
from mstar.engine.base import EngineItem
from mstar.engine.rules import TokenRules
from mstar.layers.paged_kv import DECODE_KEY_BUCKET
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


def warm_compiled(engine: AutoregressiveEngine) -> None:
    """Trace a compiled model's graphs (``LlamaForCausalLM.use_compile``) before serving, so
    that no request waits for the compiler: greedy requests through ``engine`` covering the
    shapes that trace anew: a one-token prefill, one sequence decoding past a key block (one
    row, then a longer key length), a prefill of more rows into that block, then the two
    decoding together (rows in one key block). Their pages are freed again (the prefix cache
    may keep them: the prompts are unlikely ones)."""
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 4 * DECODE_KEY_BUCKET, "stop_token_ids": []}

    def prefill(rid: str, prompt: list[int]) -> int:
        item = EngineItem(rid, "prefill", 0, {"prompt_ids": torch.tensor(prompt)}, params)
        return int(engine.run([item])[0].outputs["token"])

    def decode(last: dict[str, int], steps: int) -> None:
        for _ in range(steps):
            items = [EngineItem(rid, "decode", 0, {"token": torch.tensor([token])}, {}) for rid, token in last.items()]
            last.update((rid, int(out.outputs["token"])) for rid, out in zip(last, engine.run(items)))

    last = {"warm-a": prefill("warm-a", [0])}
    decode(last, DECODE_KEY_BUCKET + 1)
    last["warm-b"] = prefill("warm-b", [0] * (DECODE_KEY_BUCKET + 2))  # in warm-a's key block
    decode(last, 2)
    for rid in last:
        engine.release(rid)
