"""How Whisper's engines are built from its knobs: the encoder (stateless; with
``encoder_cuda_graphs``, replayed per batch bucket) and the decoder (the transcription rules
from the checkpoint's tokens; ``attention_backend``, ``cuda_graphs``, ``overlap_scheduling``)."""

from __future__ import annotations

import torch

from mstar.config import ConfigError, DeploymentConfig
from mstar.engine.autoregressive import KVLayout
from mstar.engine.base import Engine, StatelessEngine
from mstar.model.whisper.engine import WhisperDecoderEngine, WhisperRules, encoder_fn
from mstar.model.whisper.graphs import WhisperEncoderGraphs
from mstar.model.whisper.knobs import WhisperKnobs
from mstar.model.whisper.tokens import WhisperTokens


def whisper_engines(model, tokens: WhisperTokens, knobs: WhisperKnobs, config: DeploymentConfig,
                    nodes: set[str], device: torch.device) -> dict[str, Engine]:
    """The engines of ``nodes`` over ``model`` (both share its weights); every CUDA-graph
    bucket is captured now, so no request waits for a capture."""
    model.use_fused_kernels(knobs.fused_kernels)
    engines: dict[str, Engine] = {}
    if "encoder" in nodes:
        graphs = None
        if knobs.encoder_cuda_graphs:
            most = config.max_concurrent_requests
            graphs = WhisperEncoderGraphs(model, [n for n in knobs.cuda_graph_batch_sizes if n < most] + [most])
            graphs.capture_all()
        engines["encoder"] = StatelessEngine(encoder_fn(model, graphs))
    if "decoder" in nodes:
        engines["decoder"] = decoder_engine(model, tokens, knobs, config, device)
    return engines


def decoder_engine(model, tokens: WhisperTokens, knobs: WhisperKnobs, config: DeploymentConfig,
                   device: torch.device) -> WhisperDecoderEngine:
    rules = WhisperRules(
        vocab_size=model.config.vocab_size, eot=tokens.eot, sot=tokens.sot, no_timestamps=tokens.no_timestamps,
        transcribe=tokens.transcribe, translate=tokens.translate,
        language_ids=tuple(sorted(tokens.lang_to_id.values())),
        suppress=tuple(tokens.suppress_tokens), begin_suppress=tuple(tokens.begin_suppress_tokens))
    kv = config.resources.kv_cache
    try:
        engine = WhisperDecoderEngine(
            model, rules, layout=KVLayout(*model.kv_layout()), num_pages=kv.max_num_pages, page_size=kv.page_size,
            max_seq_len=model.config.max_target_positions, device=device, dtype=config.torch_dtype(),
            max_requests=config.max_concurrent_requests, **decoder_switches(knobs))
    except ValueError as err:  # the cross-attention slots do not fit max_concurrent_requests
        raise ConfigError(str(err)) from None
    if engine.graphs is not None:
        engine.graphs.capture_all()
    return engine


def decoder_switches(knobs: WhisperKnobs) -> dict:
    """The decoder engine's fast-path arguments."""
    switches = {"attention_backend": knobs.attention_backend, "overlap_scheduling": knobs.overlap_scheduling}
    if knobs.cuda_graphs:
        switches |= {"cuda_graphs": True, "graph_batch_sizes": tuple(knobs.cuda_graph_batch_sizes)}
    return switches
