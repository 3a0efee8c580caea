"""Whisper's engines: the batched audio encoder (replayed per batch bucket with CUDA graphs),
and the decoder: the autoregressive engine with Whisper's token rules (``rules.py``) and a
forward that cross-attends to fixed-shape K/V slots written once per request. ``whisper_engines``
builds both nodes from the knobs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mstar.config import ConfigError, DeploymentConfig
from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, StatelessEngine
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES, BucketGraphs, buckets_up_to
from mstar.engine.forward import Forward
from mstar.layers.paged_kv import PagedAttentionMetadata, to_device
from mstar.model.whisper.cross_kv import CrossAttentionBatch, CrossKVSlots
from mstar.model.whisper.knobs import WhisperKnobs
from mstar.model.whisper.rules import DecoderTokens, WhisperRules
from mstar.model.whisper.tokens import WhisperTokens


class EncoderGraphs:
    """The encoder's forward as per-bucket CUDA-graph replays (``model_kwargs.cuda_graphs``).

    At one clip the encoder is launch-bound (hundreds of small kernels over ~6 ms of GPU
    work); a replay launches them at once. A batch of ``B`` log-mels runs in the smallest
    bucket ``>= B``, the rows past ``B`` zero mels whose features are dropped (every row of the
    encoder is independent of the others). Batches past the largest bucket, or of a shape the
    static input does not have, run eagerly. CUDA graphs rather than ``torch.compile``: the
    same runner as the decoder, no compile time at startup, and no recompiles per batch size;
    the kernels are cuBLAS/SDPA either way, so at 32 clips, where the encoder is
    compute-bound, compile has little left to fuse.
    """

    def __init__(self, model, batch_sizes: Iterable[int]) -> None:
        self.model = model
        weight = model.model.encoder.conv1.weight
        config = model.config
        sizes = list(batch_sizes)
        mel = torch.zeros(max(sizes), config.num_mel_bins, config.num_mel_frames, dtype=weight.dtype,
                          device=weight.device)
        self.graphs = BucketGraphs(lambda rows: model.encode(rows["mel"]), {"mel": mel}, {"mel": 0.0}, sizes)

    @property
    def captured_batch_sizes(self) -> tuple[int, ...]:
        return self.graphs.captured_batch_sizes

    def capture_all(self) -> None:
        self.graphs.capture_all()

    def run(self, mel: torch.Tensor) -> torch.Tensor:
        """Audio features ``[B, frames, d_model]`` of log-mels ``[B, n_mels, num_mel_frames]``,
        as ``model.encode`` computes them."""
        static = self.graphs.buffers["mel"]
        if mel.dim() != 3 or mel.shape[1:] != static.shape[1:] or not self.graphs.fits(mel.shape[0]):
            return self.model.encode(mel)
        return self.graphs.run(mel.shape[0], {"mel": mel})


def encoder_fn(model, graphs: EncoderGraphs | None = None):
    """The encoder node: every window of the plan in one batched forward, in the model's
    device and dtype (a replay of ``graphs`` when given)."""
    encode = model.encode if graphs is None else graphs.run

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        weight = model.model.encoder.conv1.weight
        mel = torch.stack([item.inputs["mel"] for item in items])
        if mel.device != weight.device:
            mel = (mel.pin_memory() if weight.is_cuda else mel).to(weight.device, non_blocking=True)
        features = encode(mel.to(weight.dtype))
        return [{"audio_features": f} for f in features]

    return run


class CrossAttentionForward(Forward):
    """Whisper's decoder over a step, each sequence cross-attending to its audio's K/V.

    The K/V live in ``cross_slots`` (``max_requests`` slots, allocated at startup): a request
    takes one at its prefill, which writes its K/V there (all the step's prefills in one
    projection), and gives it back in ``release``, however it ends (a failed first step too:
    the engine releases fresh requests). A decode graph carries each row's slot as one more
    static input (padded rows read the sink slot); it records the decoder up to its final
    norm, and the logits are computed after the replay over the batch's rows only.
    """

    kv_from_tokens = False  # past the first layer, the K/V of a position depend on the audio

    def __init__(self, model, *, max_requests: int, dtype: torch.dtype, device: torch.device,
                 attention_backend: str) -> None:
        super().__init__(model)
        layers, frames, heads, head_dim = model.cross_layout()
        self.cross_slots = CrossKVSlots(layers, max_requests, frames, heads, head_dim, dtype, device)
        self.device = device
        self.attention_backend = attention_backend
        self.graph_rows = {"cross_slots": self.cross_slots.sink}

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict[str, Any]:
        """Each item's cross K/V slot ``[B]`` on the device; a prefill first takes one and
        writes its K/V there."""
        fresh = [item for item in items if item.op == "prefill" and not self.cross_slots.has(item.request_id)]
        if fresh:
            taken = [self.cross_slots.acquire(item.request_id) for item in fresh]
            buffer = self.cross_slots.buffer
            width = buffer.shape[-2] * buffer.shape[-1]
            features = torch.stack([item.inputs["audio_features"].reshape(-1, width).to(self.device)
                                    for item in fresh])
            slots = to_device(torch.tensor(taken, dtype=torch.int64), self.device)
            self.model.write_cross_kv(features.to(buffer.dtype), slots, self.cross_slots.layers)
        slots = [self.cross_slots.slot(item.request_id) for item in items]
        return {"cross_slots": to_device(torch.tensor(slots, dtype=torch.int64), self.device)}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict[str, Any], counts: list[int] | None) -> torch.Tensor:
        cross = CrossAttentionBatch.build(inputs["cross_slots"], counts, frames=self.cross_slots.frames,
                                          sink=self.cross_slots.sink, backend=self.attention_backend)
        return self.model.decode(input_ids, meta, kv_caches, self.cross_slots.layers, cross)

    def graph_step(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
                   rows: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.hidden(input_ids, meta, kv_caches, rows, None)

    def graph_logits(self, replayed: torch.Tensor) -> torch.Tensor:
        return self.logits(replayed)

    def release(self, request_id: str) -> None:
        self.cross_slots.free(request_id)

    def stats(self) -> dict[str, float]:
        slots = self.cross_slots
        return {"cross_kv_slots_used": slots.pool.num_used, "cross_kv_slots_total": slots.capacity}


def whisper_decoder_engine(model, tokens: DecoderTokens, layout: KVLayout, *, max_requests: int,
                           device: torch.device, dtype: torch.dtype, attention_backend: str = "torch",
                           cuda_graphs: bool = False, graph_batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
                           **kwargs) -> AutoregressiveEngine:
    """The decoder node (``kwargs``: the engine's pool sizes and ``overlap_scheduling``). Its
    graph buckets stop at ``max_requests``: no more sequences are ever live."""
    forward = CrossAttentionForward(model, max_requests=max_requests, dtype=dtype, device=device,
                                    attention_backend=attention_backend)
    sizes = tuple(size for size in graph_batch_sizes if size < max_requests) + (max_requests,)
    rules = WhisperRules(tokens, device, max_len=model.config.max_target_positions)
    return AutoregressiveEngine(model, layout, device=device, dtype=dtype, rules=rules,
                                forward=forward, attention_backend=attention_backend, cuda_graphs=cuda_graphs,
                                graph_batch_sizes=sizes, **kwargs)


def whisper_engines(model, tokens: WhisperTokens, knobs: WhisperKnobs, config: DeploymentConfig,
                    nodes: set[str], device: torch.device) -> dict[str, Engine]:
    """The engines of ``nodes`` over ``model`` (both share its weights) from the knobs; every
    CUDA-graph bucket is captured now, so no request waits for a capture."""
    model.use_fused_kernels(knobs.fused_kernels)
    engines: dict[str, Engine] = {}
    if "encoder" in nodes:
        graphs = None
        if knobs.encoder_cuda_graphs:
            graphs = EncoderGraphs(model, buckets_up_to(config.max_concurrent_requests, knobs.cuda_graph_batch_sizes))
            graphs.capture_all()
        engines["encoder"] = StatelessEngine(encoder_fn(model, graphs))
    if "decoder" in nodes:
        ids = DecoderTokens(
            vocab_size=model.config.vocab_size, eot=tokens.eot, sot=tokens.sot, no_timestamps=tokens.no_timestamps,
            transcribe=tokens.transcribe, translate=tokens.translate,
            language_ids=tuple(sorted(tokens.lang_to_id.values())),
            suppress=tuple(tokens.suppress_tokens), begin_suppress=tuple(tokens.begin_suppress_tokens),
            no_speech=tokens.no_speech)
        kv = config.resources.kv_cache
        try:
            decoder = whisper_decoder_engine(
                model, ids, KVLayout(*model.kv_layout()), max_requests=config.max_concurrent_requests,
                device=device, dtype=config.torch_dtype(), num_pages=kv.max_num_pages, page_size=kv.page_size,
                max_seq_len=model.config.max_target_positions, **decoder_switches(knobs))
        except ValueError as err:  # the cross-attention slots do not fit max_concurrent_requests
            raise ConfigError(str(err)) from None
        if decoder.graphs is not None:
            decoder.graphs.capture_all()
        engines["decoder"] = decoder
    return engines


def decoder_switches(knobs: WhisperKnobs) -> dict[str, Any]:
    """The decoder engine's fast-path arguments."""
    switches: dict[str, Any] = {"attention_backend": knobs.attention_backend,
                                "overlap_scheduling": knobs.overlap_scheduling}
    if knobs.cuda_graphs:
        switches |= {"cuda_graphs": True, "graph_batch_sizes": tuple(knobs.cuda_graph_batch_sizes)}
    return switches
